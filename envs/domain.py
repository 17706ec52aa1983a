"""The one place that writes sampled domain parameters into a live MjModel.

Every `apply` starts from a saved nominal copy of each randomized array, so
nothing drifts across episodes, then multiplies in that episode's scales.
Nothing here runs per step.
"""

from __future__ import annotations

import mujoco

from envs.randomization import RandomizationError, RandomizationSet

_DOF_COUNT = {
    int(mujoco.mjtJoint.mjJNT_FREE): 6,
    int(mujoco.mjtJoint.mjJNT_BALL): 3,
    int(mujoco.mjtJoint.mjJNT_SLIDE): 1,
    int(mujoco.mjtJoint.mjJNT_HINGE): 1,
}

_GROUP_OBJECT = {
    "body_mass": mujoco.mjtObj.mjOBJ_BODY,
    "geom_friction": mujoco.mjtObj.mjOBJ_GEOM,
    "joint_damping": mujoco.mjtObj.mjOBJ_JOINT,
    "joint_stiffness": mujoco.mjtObj.mjOBJ_JOINT,
    "joint_armature": mujoco.mjtObj.mjOBJ_JOINT,
    "tendon_stiffness": mujoco.mjtObj.mjOBJ_TENDON,
    "actuator_gain": mujoco.mjtObj.mjOBJ_ACTUATOR,
}


def element_names(model: mujoco.MjModel, obj: mujoco.mjtObj) -> list[str]:
    """Names of all named elements of one kind in the model."""
    count = {
        mujoco.mjtObj.mjOBJ_BODY: model.nbody,
        mujoco.mjtObj.mjOBJ_GEOM: model.ngeom,
        mujoco.mjtObj.mjOBJ_JOINT: model.njnt,
        mujoco.mjtObj.mjOBJ_ACTUATOR: model.nu,
        mujoco.mjtObj.mjOBJ_TENDON: model.ntendon,
    }[obj]
    names = (mujoco.mj_id2name(model, obj, i) for i in range(count))
    return [n for n in names if n]


def element_id(model: mujoco.MjModel, group: str, name: str, label: str = "model", key: str | None = None) -> int:
    """Id of the named element that `group` randomizes; a clear error naming it when absent."""
    obj = _GROUP_OBJECT[group]
    idx = mujoco.mj_name2id(model, obj, name)
    if idx < 0:
        kind = group.split("_")[0]
        raise RandomizationError(
            f"randomization {key or group}: no {kind} named {name!r} in {label}; "
            f"{kind}s are: {element_names(model, obj)}"
        )
    return idx


class DomainRandomizer:
    """Binds a RandomizationSet to one MjModel and applies sampled parameters from the nominal copy."""

    def __init__(self, model: mujoco.MjModel, rset: RandomizationSet, label: str = "model"):
        self.model = model
        self._scratch = mujoco.MjData(model)
        self._bodies = {n: element_id(model, "body_mass", n, label) for n in rset.body_mass}
        self._geoms = {n: element_id(model, "geom_friction", n, label) for n in rset.geom_friction}
        self._actuators = {n: element_id(model, "actuator_gain", n, label) for n in rset.actuator_gain}
        self._dofs = {}
        for n in rset.joint_damping:
            j = element_id(model, "joint_damping", n, label)
            start = int(model.jnt_dofadr[j])
            self._dofs[n] = slice(start, start + _DOF_COUNT[int(model.jnt_type[j])])
        self._springs = {n: element_id(model, "joint_stiffness", n, label) for n in rset.joint_stiffness}
        self._armatures = {}
        for n in rset.joint_armature:
            j = element_id(model, "joint_armature", n, label)
            start = int(model.jnt_dofadr[j])
            dofs = slice(start, start + _DOF_COUNT[int(model.jnt_type[j])])
            if not float(model.dof_armature[dofs].max()) > 0.0:
                # A scale of nothing is nothing: the range would be sampled, logged and fitted, and change no plant.
                raise RandomizationError(
                    f"randomization joint_armature.{n}: joint {n!r} has no armature in {label} (0), so no scale "
                    f"changes it; give it its nominal reflected inertia (<joint armature=...>) or leave it out"
                )
            self._armatures[n] = dofs
        self._tendons = {n: element_id(model, "tendon_stiffness", n, label) for n in rset.tendon_stiffness}
        if rset.push is not None:
            element_id(model, "body_mass", rset.push.body, label, key="push.body")
        # Nominal copies of every array a set may touch (taken before any randomization).
        self.nominal = {
            "body_mass": model.body_mass.copy(),
            "body_inertia": model.body_inertia.copy(),
            "geom_friction": model.geom_friction.copy(),
            "dof_damping": model.dof_damping.copy(),
            "jnt_stiffness": model.jnt_stiffness.copy(),
            "dof_armature": model.dof_armature.copy(),
            "tendon_stiffness": model.tendon_stiffness.copy(),
            "actuator_gainprm": model.actuator_gainprm.copy(),
            "actuator_biasprm": model.actuator_biasprm.copy(),
            "gravity": model.opt.gravity.copy(),
        }

    def apply(self, params: dict[str, float]) -> None:
        """Write nominal x sampled scales into the live model; missing entries mean nominal."""
        m, nom = self.model, self.nominal
        if self._bodies:
            m.body_mass[:] = nom["body_mass"]
            m.body_inertia[:] = nom["body_inertia"]
            for name, i in self._bodies.items():
                s = params.get(f"body_mass.{name}", 1.0)
                m.body_mass[i] = nom["body_mass"][i] * s
                m.body_inertia[i] = nom["body_inertia"][i] * s
        if self._geoms:
            m.geom_friction[:] = nom["geom_friction"]
            for name, i in self._geoms.items():
                m.geom_friction[i] = nom["geom_friction"][i] * params.get(f"geom_friction.{name}", 1.0)
        if self._dofs:
            m.dof_damping[:] = nom["dof_damping"]
            for name, sl in self._dofs.items():
                m.dof_damping[sl] = nom["dof_damping"][sl] * params.get(f"joint_damping.{name}", 1.0)
        if self._springs:
            m.jnt_stiffness[:] = nom["jnt_stiffness"]
            for name, j in self._springs.items():
                m.jnt_stiffness[j] = nom["jnt_stiffness"][j] * params.get(f"joint_stiffness.{name}", 1.0)
        if self._armatures:
            m.dof_armature[:] = nom["dof_armature"]
            for name, sl in self._armatures.items():
                m.dof_armature[sl] = nom["dof_armature"][sl] * params.get(f"joint_armature.{name}", 1.0)
        if self._tendons:
            m.tendon_stiffness[:] = nom["tendon_stiffness"]
            for name, t in self._tendons.items():
                m.tendon_stiffness[t] = nom["tendon_stiffness"][t] * params.get(f"tendon_stiffness.{name}", 1.0)
        if self._actuators:
            m.actuator_gainprm[:] = nom["actuator_gainprm"]
            m.actuator_biasprm[:] = nom["actuator_biasprm"]
            for name, i in self._actuators.items():
                s = params.get(f"actuator_gain.{name}", 1.0)
                # gainprm[0] is force per ctrl; biasprm[1:3] keep position/velocity servos consistent.
                m.actuator_gainprm[i, 0] = nom["actuator_gainprm"][i, 0] * s
                m.actuator_biasprm[i, 1:3] = nom["actuator_biasprm"][i, 1:3] * s
        m.opt.gravity[:] = nom["gravity"] * params.get("gravity_scale", 1.0)
        if self._bodies or self._armatures:
            # Masses and armature feed derived constants (subtree masses, the inverse weights at the reference pose
            # that constraint softness uses).
            mujoco.mj_setConst(m, self._scratch)
