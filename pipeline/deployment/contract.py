"""The bundle's I/O contract (shield.contract) built at export, from the task and the policy being exported."""

from __future__ import annotations

import numpy as np

from shield.contract import RESET_RULES, check_contract, contract_sha256

# A plant estimate's units (envs.wrappers.domain_encoding's names): scales of the nominal value, except these.
ESTIMATE_UNITS = {"latency_steps": "control periods"}
EXPECTED_SIGMA = 5.0  # an observation this many training standard deviations from the mean is out of range


def task_io(env_id: str, obs_dim: int, act_dim: int) -> tuple[dict, float | None]:
    """(the task's observations and actions as declared, its control period): a gymnasium env trained by id (no
    task declaration) gets positional names, no units and no period."""
    import envs.registry

    io, period = envs.registry.describe_io(env_id)
    if io is None:
        io = {
            "observations": [{"name": f"obs_{i}", "source": "", "unit": ""} for i in range(obs_dim)],
            "actions": [
                {"name": f"action_{j}", "source": "", "unit": "", "units_per_action": 1.0} for j in range(act_dim)
            ],
        }
    return io, period


def io_contract(
    env_id: str,
    obs_mean,
    obs_std,
    action_low,
    action_high,
    history_length: int = 0,
    state_names: tuple[str, str] = ("history", "next_history"),
    estimates: list | None = None,
    estimate_output: str = "plant_estimate",
    estimate_skill: dict | None = None,
) -> dict:
    """Names, sources, units and expected ranges of the observations; names, units, physical scale and bounds of
    the actions; the control period; the policy's state and reset rules; with `estimates` ([name, low, high, log
    scale] each, `envs.wrappers.domain_encoding`'s), the plant parameters the policy estimates, each with its
    held-out R^2 where `estimate_skill` ({name: R^2 or None}) measured one. A gymnasium env
    trained by id (no task declaration) gets its positions as names and no units."""
    mean, std = np.asarray(obs_mean, np.float64), np.asarray(obs_std, np.float64)
    low, high = np.asarray(action_low, np.float64), np.asarray(action_high, np.float64)
    io, period = task_io(env_id, len(mean), len(low))
    observations = []
    for o, m, s in zip(io["observations"], mean, std, strict=True):
        o = dict(o)
        # A set-point's values are declared exactly (its target box); anything else, from the training data, and a
        # limited joint's position never beyond its stops (a cart's spread of 0.4 m read +-2 m on a +-1.2 m rail).
        low_high = o.pop("range", None) or (m - EXPECTED_SIGMA * s, m + EXPECTED_SIGMA * s)
        stops = o.pop("stops", None)
        if "wraps_around" in o:  # observed wrapped: never beyond half a turn either way of its centre
            stops = (o["wraps_around"] - np.pi, o["wraps_around"] + np.pi)
        if stops is not None and max(low_high[0], stops[0]) < min(low_high[1], stops[1]):
            low_high = (max(low_high[0], stops[0]), min(low_high[1], stops[1]))
        observations.append({**o, "expected_low": float(low_high[0]), "expected_high": float(low_high[1])})
    actions = [
        {**a, "units_per_action": float(a["units_per_action"]), "low": float(lo), "high": float(hi)}
        for a, lo, hi in zip(io["actions"], low, high, strict=True)
    ]
    state = (
        {"kind": "none"}
        if not history_length
        else {
            "kind": "history",
            "length": int(history_length),
            "input": state_names[0],
            "output": state_names[1],
            "shape": [1, int(history_length), len(mean) + len(low)],
            "dtype": "float32",
            "initial": "zeros",
            "holds": "row k: the observation (raw, as sent; obs_dim values) then the action the plant was sent (after "
            "the shield; act_dim values) k + 1 steps ago, newest first",
            "after_step": f"{state_names[1]}'s newest row holds the policy's own action; the runtime writes the "
            "action the plant was really sent over it before the next step",
            "reset_on": list(RESET_RULES),
            "reset_rules": dict(RESET_RULES),
        }
    )
    contract: dict[str, object] = {
        "control_period_s": period,
        "observations": observations,
        "actions": actions,
        "policy_state": state,
        "expected_range": f"the training observations' mean +- {EXPECTED_SIGMA:g} std, within a limited joint's "
        "stops; a set-point's declared box",
    }
    if estimates:
        contract["plant_estimate"] = {
            "output": estimate_output,
            "parameters": [
                {
                    "name": name,
                    "unit": ESTIMATE_UNITS.get(name, "x nominal"),
                    "low": float(lo),
                    "high": float(hi),
                    **({"held_out_r2": estimate_skill.get(name)} if estimate_skill else {}),
                }
                for name, lo, hi, _ in estimates
            ],
            "holds": "the domain parameters the policy infers from its history, each within its train range; "
            "held_out_r2: how much of a parameter's spread it explained on episodes it was neither trained nor "
            "recalibrated on (1 exact, 0 no better than the middle of the range, null: the parameter did not vary)",
        }
    contract["names_sha256"] = contract_sha256(contract)
    return check_contract(contract, len(mean), len(low))
