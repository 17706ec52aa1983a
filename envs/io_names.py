"""What a task's observations and actions are: name, source and unit, for the bundle's I/O contract.

A controller written from the bundle alone must know which number goes where and in which unit. For a
declared plant the names come from the declaration, the sources and units from the MJCF (a slide joint's
position is in m, a hinge's in rad, a motor on a slide pushes in N, on a hinge in N m); a declaration's
`unit` says it where MuJoCo cannot (a target, most sensors). A code task lists its own.
"""

from __future__ import annotations

from pathlib import Path

import mujoco

from envs.declaration import PlantDeclaration
from envs.declared_env import bind, observed_wraps

# Joint type -> (position unit, velocity unit, actuator force unit)
_JOINT_UNITS = {
    mujoco.mjtJoint.mjJNT_SLIDE: ("m", "m/s", "N"),
    mujoco.mjtJoint.mjJNT_HINGE: ("rad", "rad/s", "N m"),
    mujoco.mjtJoint.mjJNT_BALL: ("rad", "rad/s", "N m"),
    mujoco.mjtJoint.mjJNT_FREE: ("m", "m/s", "N"),
}
# Sensor type -> unit, for the sensors whose unit MuJoCo fixes.
_SENSOR_UNITS = {
    mujoco.mjtSensor.mjSENS_ACCELEROMETER: "m/s^2",
    mujoco.mjtSensor.mjSENS_VELOCIMETER: "m/s",
    mujoco.mjtSensor.mjSENS_GYRO: "rad/s",
    mujoco.mjtSensor.mjSENS_FORCE: "N",
    mujoco.mjtSensor.mjSENS_TORQUE: "N m",
    mujoco.mjtSensor.mjSENS_FRAMEPOS: "m",
    mujoco.mjtSensor.mjSENS_FRAMELINVEL: "m/s",
    mujoco.mjtSensor.mjSENS_FRAMEANGVEL: "rad/s",
    mujoco.mjtSensor.mjSENS_TOUCH: "N",
    mujoco.mjtSensor.mjSENS_RANGEFINDER: "m",
}


def _joint_unit(model: mujoco.MjModel, joint: int, quantity: str) -> str:
    pos, vel, _ = _JOINT_UNITS.get(int(model.jnt_type[joint]), ("", "", ""))
    return pos if quantity == "pos" else vel


def _stops(model: mujoco.MjModel, joint: int) -> list[float] | None:
    """A limited slide or hinge joint's range (its hard stops: MuJoCo's constraint keeps qpos within it, up to the
    contact's give), else None."""
    if not model.jnt_limited[joint] or int(model.jnt_type[joint]) not in (
        mujoco.mjtJoint.mjJNT_SLIDE,
        mujoco.mjtJoint.mjJNT_HINGE,
    ):
        return None
    return [float(model.jnt_range[joint, 0]), float(model.jnt_range[joint, 1])]


def declared_io(decl: PlantDeclaration, mjcf: Path) -> dict:
    """{"observations": [{name, source, unit}, with a set-point's declared box as "range", a limited joint's
    position with its "stops", the angle of a hinge without a range with the angle it is observed wrapped around
    ("wraps_around": into (c - pi, c + pi], as the env observes it)], "actions": [{name, source, unit,
    units_per_action}]}."""
    model = mujoco.MjModel.from_xml_path(str(mjcf))
    wraps_around = dict(observed_wraps(decl, model, bind(decl, model, mjcf.name)))  # the env's own rule
    observations = []
    for i, o in enumerate(decl.observations):
        stops = None
        if o.joint is not None:
            jid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, o.joint)
            source, unit = (
                f"joint {o.joint} {'qpos' if o.quantity == 'pos' else 'qvel'}",
                _joint_unit(model, jid, o.quantity),
            )
            stops = _stops(model, jid) if o.quantity == "pos" else None
        elif o.site is not None:
            source, unit = f"site {o.site} world position axis {o.axis}", "m"
        elif o.sensor is not None:
            sid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SENSOR, o.sensor)
            stype = int(model.sensor_type[sid])
            unit = _SENSOR_UNITS.get(stype, "")
            if stype in (mujoco.mjtSensor.mjSENS_JOINTPOS, mujoco.mjtSensor.mjSENS_JOINTVEL):
                unit = _joint_unit(
                    model, int(model.sensor_objid[sid]), "pos" if stype == mujoco.mjtSensor.mjSENS_JOINTPOS else "vel"
                )
            source = f"sensor {o.sensor}[{o.index}]"
        else:
            source, unit = f"target {o.target}[{o.index}]", ""
        entry = {"name": o.name, "source": source, "unit": o.unit if o.unit is not None else unit}
        if o.target is not None:  # a set-point never leaves its declared box (ramped between goals drawn in it)
            box = decl.targets[o.target]
            entry["range"] = [float(box.low[o.index]), float(box.high[o.index])]
        elif stops is not None:
            entry["stops"] = stops
        if i in wraps_around:
            entry["wraps_around"] = wraps_around[i]
        observations.append(entry)
    return {"observations": observations, "actions": [_action(model, a) for a in decl.actuators]}


def _action(model: mujoco.MjModel, actuator) -> dict:
    """A motor on a joint (fixed gain, no bias) applies scale x gain x gear force per unit action: N on a slide,
    N m on a hinge. Anything else (a position servo, a tendon) is stated in ctrl units unless declared."""
    aid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_ACTUATOR, actuator.name)
    unit, per_action = "ctrl", actuator.scale
    motor = (
        int(model.actuator_gaintype[aid]) == mujoco.mjtGain.mjGAIN_FIXED
        and int(model.actuator_biastype[aid]) == mujoco.mjtBias.mjBIAS_NONE
    )
    if int(model.actuator_trntype[aid]) == mujoco.mjtTrn.mjTRN_JOINT and motor:
        unit = _JOINT_UNITS.get(int(model.jnt_type[model.actuator_trnid[aid, 0]]), ("", "", "ctrl"))[2]
        per_action = actuator.scale * float(model.actuator_gainprm[aid, 0]) * float(model.actuator_gear[aid, 0])
    if actuator.units_per_action is not None:
        per_action = actuator.units_per_action
    return {
        "name": actuator.name,
        "source": f"actuator {actuator.name}",
        "unit": actuator.unit if actuator.unit is not None else unit,
        "units_per_action": per_action,
    }
