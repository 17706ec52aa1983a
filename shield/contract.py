"""The bundle's I/O contract: what the policy expects and answers, stated so a controller needs nothing else.

`manifest.json` (schema 2) carries it under ``contract``::

    {"control_period_s": 0.02,
     "observations": [{"name": "x", "source": "joint slider qpos", "unit": "m",
                       "expected_low": -1.1, "expected_high": 1.1},
                      {"name": "theta", "source": "joint hinge qpos", "unit": "rad", "wraps_around": 0.0, ...},
                      ...],
     "actions": [{"name": "cart_force", "source": "actuator cart_force", "unit": "N",
                  "units_per_action": 30.0, "low": -1.0, "high": 1.0}, ...],
     "policy_state": {"kind": "none"},
     "expected_range": "the training observations' mean +- 5 std, within a limited joint's stops; a set-point's
                       declared box",
     "names_sha256": "..."}

`wraps_around` (an angle of a hinge that turns without limit): the policy was trained on it wrapped into
(c - pi, c + pi]; the edge wraps a plant's reading the same way before the policy sees it (`observation_wraps`),
so a multi-turn encoder count is the angle it is.
`names_sha256` hashes the observation and action names and units in order, each action's units_per_action and the
control period (contract_sha256): a controller built against one bundle compares it with the server's (its status
reply) and refuses to run against another.
A history policy's state is ``{"kind": "history", "length": H, "input": "history", "output": "next_history",
"shape": [1, H, obs_dim + act_dim], "dtype": "float32", "initial": "zeros", "reset_on": [...], ...}``: named
graph tensors, an input and an output; the edge runtime keeps one per plant session and starts it from zeros
on each event of `RESET_RULES` listed (bundles exported before the state became a graph output state only
`length`, `initial` and prose `reset`).

An adaptive policy that estimates the plant states it under ``plant_estimate``::

    {"output": "plant_estimate",
     "parameters": [{"name": "body_mass.cart", "unit": "x nominal", "low": 0.75, "high": 1.4,
                     "held_out_r2": 0.12}, ...]}

one entry per column of that graph output, in order, each with the train range the policy learnt it over
(its estimate never leaves it) and, from an adaptive run, the share of the parameter's spread the estimate
explained on episodes it was neither trained nor recalibrated on (`held_out_r2`; near 0: the history does not
reveal it, read it as the range's middle). At most MAX_ESTIMATES, so the estimate reply fits in its request's padding.

Stdlib only: this runs on the edge box.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

POLICY_STATE_KINDS = ("none", "history")
# When the edge starts a plant's policy state afresh (docs/reference/contracts.md, "Policy state").
RESET_RULES = {
    "new_plant_session": "a client the server holds no session for (first request, or its session was evicted)",
    "new_episode": "the controller sets the RESET_STATE request flag (a new episode), or in-process reset()",
    "reply_lost": "the controller sets RESET_STATE on the request after one it got no usable reply to (lost, "
    "late or unauthenticated): the plant applied its own fallback, which the state never saw",
    "silence": "the plant was silent longer than a live plant may be (the server's plant-live time)",
    "reload": "a new bundle is served (hot reload): its policy starts from its own initial state",
}


MAX_ESTIMATES = 48  # parameters a plant estimate may state (shield.protocol.ESTIMATE_REQUEST_PAD holds them)


class ContractError(ValueError):
    """A contract that does not say what it must; the message names the key."""


def names_sha256(
    observations: list[str], actions: list[str], control_period_s: float | None, estimates: list[str] | None = None
) -> str:
    """The older bundles' hash (contract_sha256 is today's): observation and action names in order, the control
    period (s), and the names of the plant parameters the policy estimates, in order, where it estimates any."""
    names: dict[str, object] = {
        "observations": list(observations),
        "actions": list(actions),
        "control_period_s": control_period_s,
    }
    if estimates:
        names["plant_estimate"] = list(estimates)
    return hashlib.sha256(json.dumps(names, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def contract_sha256(contract: dict) -> str:
    """The hash a controller checks (`names_sha256`): names_sha256's, and each observation's and action's unit and
    each action's units_per_action, in order. A controller compiled for a torque motor (N m, 3 per unit) must
    notice a bundle for a position servo (rad) or a regeared drive with the same names."""
    names: dict[str, object] = {
        "observations": [o["name"] for o in contract["observations"]],
        "actions": [a["name"] for a in contract["actions"]],
        "control_period_s": contract.get("control_period_s"),
        "observation_units": [o["unit"] for o in contract["observations"]],
        "action_units": [[a["unit"], a["units_per_action"]] for a in contract["actions"]],
    }
    if estimates := estimate_names(contract):
        names["plant_estimate"] = estimates
    return hashlib.sha256(json.dumps(names, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _number(value: Any, key: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ContractError(f"{key}: must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ContractError(f"{key}: must be > 0, got {value!r}")
    return float(value)


def check_contract(contract: Any, obs_dim: int | None = None, act_dim: int | None = None) -> dict:
    """`contract` checked: names, units and numbers where they belong, sizes as the policy's, the hash its own."""
    if not isinstance(contract, dict):
        raise ContractError("contract: must be an object")
    period = contract.get("control_period_s")
    if period is not None:
        _number(period, "contract.control_period_s", positive=True)
    for kind, dim, numbers in (
        ("observations", obs_dim, ("expected_low", "expected_high")),
        ("actions", act_dim, ("units_per_action", "low", "high")),
    ):
        entries = contract.get(kind)
        if not isinstance(entries, list) or not entries:
            raise ContractError(f"contract.{kind}: must be a non-empty list")
        if dim is not None and len(entries) != dim:
            raise ContractError(f"contract.{kind}: {len(entries)} entries, the policy has {dim}")
        for i, entry in enumerate(entries):
            key = f"contract.{kind}[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
                raise ContractError(f"{key}.name: must be a non-empty string")
            for text in ("source", "unit"):
                if not isinstance(entry.get(text), str):
                    raise ContractError(f"{key}.{text}: must be a string")
            for n in numbers:
                _number(entry.get(n), f"{key}.{n}")
            if kind == "observations" and "wraps_around" in entry:
                _number(entry["wraps_around"], f"{key}.wraps_around")
    state = contract.get("policy_state")
    if not isinstance(state, dict) or state.get("kind") not in POLICY_STATE_KINDS:
        raise ContractError(f"contract.policy_state.kind: must be one of {POLICY_STATE_KINDS}")
    if state["kind"] != "none":
        _check_state(state)
    if contract.get("plant_estimate") is not None:
        if state["kind"] == "none":
            raise ContractError("contract.plant_estimate: a policy without state cannot estimate the plant")
        _check_estimate(contract["plant_estimate"])
    names = [o["name"] for o in contract["observations"]], [a["name"] for a in contract["actions"]], period
    # Bundles exported before the units (2026-11-30) or the estimate's names were hashed state the older recipes: they
    # still load (production may be one), and their hash does not tell those apart.
    older = {names_sha256(*names, estimate_names(contract)), names_sha256(*names)}
    if contract.get("names_sha256") not in {contract_sha256(contract), *older}:
        raise ContractError(
            "contract.names_sha256: does not hash the contract's names, units, control period and estimated parameters"
        )
    return contract


def _check_state(state: dict) -> None:
    length = state.get("length")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ContractError(f"contract.policy_state.length: must be a whole number >= 1, got {length!r}")
    if state.get("initial") != "zeros":
        raise ContractError(f"contract.policy_state.initial: must be 'zeros', got {state.get('initial')!r}")
    if "input" not in state:  # stated before the state was a graph output: nothing more to check
        return
    for key in ("input", "output"):
        if not isinstance(state.get(key), str) or not state[key]:
            raise ContractError(f"contract.policy_state.{key}: must name a tensor of policy.onnx")
    shape = state.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or shape[1] != length
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise ContractError(f"contract.policy_state.shape: must be [1, {length}, obs_dim + act_dim], got {shape!r}")
    if state.get("dtype") != "float32":
        raise ContractError(f"contract.policy_state.dtype: must be 'float32', got {state.get('dtype')!r}")
    rules = state.get("reset_on")
    if not isinstance(rules, list) or not set(rules) <= set(RESET_RULES):
        raise ContractError(f"contract.policy_state.reset_on: must list rules of {sorted(RESET_RULES)}")


def _check_estimate(estimate: Any) -> None:
    if not isinstance(estimate, dict) or not isinstance(estimate.get("output"), str) or not estimate["output"]:
        raise ContractError("contract.plant_estimate.output: must name a tensor of policy.onnx")
    params = estimate.get("parameters")
    if not isinstance(params, list) or not 1 <= len(params) <= MAX_ESTIMATES:
        raise ContractError(f"contract.plant_estimate.parameters: must list 1 to {MAX_ESTIMATES} parameters")
    for i, entry in enumerate(params):
        key = f"contract.plant_estimate.parameters[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ContractError(f"{key}.name: must be a non-empty string")
        if not isinstance(entry.get("unit"), str):
            raise ContractError(f"{key}.unit: must be a string")
        if _number(entry.get("low"), f"{key}.low") > _number(entry.get("high"), f"{key}.high"):
            raise ContractError(f"{key}: low {entry['low']} is above high {entry['high']}")
        if entry.get("held_out_r2") is not None:
            _number(entry["held_out_r2"], f"{key}.held_out_r2")


def observation_wraps(contract: dict | None) -> list[tuple[int, float]]:
    """(observation index, centre) of each observation the policy was trained on wrapped into (c - pi, c + pi]
    (an angle of a hinge that turns without limit): what the edge wraps a plant's reading into before the policy
    sees it. [] without a contract (a bundle exported before it, or a task declaring no I/O)."""
    if not contract:
        return []
    return [(i, float(o["wraps_around"])) for i, o in enumerate(contract["observations"]) if "wraps_around" in o]


def estimate_names(contract: dict | None) -> list[str]:
    """The names of the parameters the policy estimates, in its output's order; [] when it estimates none."""
    estimate = (contract or {}).get("plant_estimate")
    return [p["name"] for p in estimate["parameters"]] if estimate else []


def describe(contract: dict | None) -> list[str]:
    """Human lines: the control period, each observation and action with its unit, the policy's state, the hash."""
    if not contract:
        return ["no I/O contract (a schema-1 bundle): the task's config says what the observations are"]
    period = contract.get("control_period_s")
    lines = [
        f"control period {period:g} s" if period else "control period not stated",
        "observations: " + ", ".join(f"{o['name']} [{o['unit'] or '-'}]" for o in contract["observations"]),
        "actions: "
        + ", ".join(
            f"{a['name']} [{a['units_per_action']:g} {a['unit'] or 'units'} per unit, {a['low']:g}..{a['high']:g}]"
            for a in contract["actions"]
        ),
        "policy state: " + _describe_state(contract["policy_state"]),
        f"names sha256: {contract['names_sha256']}",
    ]
    estimate = contract.get("plant_estimate")
    if estimate:
        lines.append(
            f"plant estimate ({estimate['output']}): "
            + ", ".join(
                f"{p['name']} [{p['unit'] or '-'}, {p['low']:g}..{p['high']:g}{_skill(p)}]"
                for p in estimate["parameters"]
            )
        )
    return lines


def _skill(parameter: dict) -> str:
    """The held-out R^2 where export measured one: how far the operator may trust that estimate."""
    if "held_out_r2" not in parameter:
        return ""
    r2 = parameter["held_out_r2"]
    return ", held-out R^2 " + ("n/a (did not vary)" if r2 is None else f"{r2:.2f}")


def _describe_state(state: dict) -> str:
    if state["kind"] == "none" or "input" not in state:
        return state["kind"]
    return (
        f"{state['kind']} {state['input']} -> {state['output']} {state['dtype']}{state['shape']}, "
        f"initial {state['initial']}, reset on {', '.join(state['reset_on'])}"
    )
