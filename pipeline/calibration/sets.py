"""Randomization sets around a calibration: configured ranges, the `calibrated` set, re-centred training ranges."""

from __future__ import annotations

import math

from pipeline.calibration.identify import OUTSIDE_INTERVAL
from pipeline.calibration.twin import PHYSICAL_GROUPS, put_range


def configured_ranges(cfg) -> dict[str, tuple[float, float]]:
    """Hull over the config's sets of every physical scale range, by parameter name."""
    hull: dict[str, tuple[float, float]] = {}
    for rset in cfg.randomization.values():
        items = [(f"{g}.{el}", r) for g in PHYSICAL_GROUPS for el, r in getattr(rset, g).items()]
        if rset.gravity_scale is not None:
            items.append(("gravity_scale", rset.gravity_scale))
        for name, r in items:
            lo, hi = hull.get(name, (r.low, r.high))
            hull[name] = (min(lo, r.low), max(hi, r.high))
    return hull


def kept_from(cfg, name: str) -> tuple[str, tuple[float, float]]:
    """The range an unidentified parameter keeps: `reality`'s, else `train`'s, else the hull's; with the set it comes
    from ('reality', 'train', or 'every set' for the hull)."""
    for set_name in ("reality", "train"):
        rset = cfg.randomization.get(set_name)
        if rset is None:
            continue
        if name == "gravity_scale" and rset.gravity_scale is not None:
            return set_name, (rset.gravity_scale.low, rset.gravity_scale.high)
        group, _, element = name.partition(".")
        r = getattr(rset, group, {}).get(element) if group in PHYSICAL_GROUPS else None
        if r is not None:
            return set_name, (r.low, r.high)
    return "every set", configured_ranges(cfg)[name]


def obs_noise_vector(std: list[float], dim: int) -> list[float]:
    return [float(std[0])] * dim if len(std) == 1 else [float(s) for s in std]


def configured_dist(cfg, name: str) -> str:
    """The distribution a parameter's range is drawn with in `reality` (else `train`): a calibrated range keeps it."""
    if cfg is None:
        return "uniform"
    for set_name in ("reality", "train"):
        rset = cfg.randomization.get(set_name)
        if rset is None:
            continue
        if name == "gravity_scale":
            r = rset.gravity_scale
        else:
            group, _, element = name.partition(".")
            r = getattr(rset, group, {}).get(element) if group in PHYSICAL_GROUPS else None
        if r is not None:
            return r.dist
    return "uniform"


def calibrated_set(result: dict, reality, cfg=None) -> dict:
    """The `calibrated` RandomizationSet dict (YAML format) of a calibration result.

    Each range keeps its configured distribution (loguniform stays loguniform).
    Action noise and pushes are not visible in the logs as such: they keep `reality`'s.
    """
    out: dict = {}
    for name, p in result["parameters"].items():
        put_range(out, name, {"dist": configured_dist(cfg, name), "low": p["range"][0], "high": p["range"][1]})
    lat = result["latency_steps"]
    # A latency the runner-up is not ruled out against (the outside verdict's confidence): both, as a latency
    # varying between them reads.
    both = [lat["identified"]]
    if lat.get("runner_up") is not None and lat.get("confidence", 1.0) < OUTSIDE_INTERVAL:
        both.append(lat["runner_up"])
    out["latency_steps"] = {"low": min(both), "high": max(both)}
    out["obs_noise_std"] = list(result["obs_noise_std"])
    out["action_noise_std"] = list(reality.action_noise_std)
    if reality.push is not None:
        out["push"] = reality.push.model_dump()
    return out


def _set_range(rset: dict, name: str):
    if name == "gravity_scale":
        return rset.get("gravity_scale")
    group, element = name.split(".", 1)
    return rset.get(group, {}).get(element)


def recentred_training(cfg, result: dict) -> dict:
    """The config's data with `randomization.calibrated` added and `train` moved onto it.

    Identified parameters: train's range keeps its width (ratio high/low) but is
    centred (geometrically) on the identified scale, clipped to the hull of the
    configured sets (the shield's envelope is derived from them), then widened to
    cover the calibrated range. Unidentified ones: train widened to cover the
    calibrated (= configured) range. Latency and observation noise: widened to cover.
    """
    data = cfg.model_dump(mode="json", exclude_none=True)
    calibrated = result["calibrated"]
    data["randomization"]["calibrated"] = calibrated
    train = data["randomization"]["train"]
    hull = configured_ranges(cfg)
    for name, p in result["parameters"].items():
        lo, hi = p["range"]
        current = _set_range(train, name)
        if current is not None and p["identified_ok"]:
            half = math.sqrt(current["high"] / current["low"])
            c = p["identified"]
            lo_h, hi_h = hull[name]
            lo, hi = min(lo, max(c / half, lo_h)), max(hi, min(c * half, hi_h))
        elif current is not None:
            lo, hi = min(lo, current["low"]), max(hi, current["high"])
        put_range(train, name, {"dist": configured_dist(cfg, name), "low": lo, "high": hi})
    lat = calibrated["latency_steps"]
    old = train.get("latency_steps") or lat
    train["latency_steps"] = {"low": min(old["low"], lat["low"]), "high": max(old["high"], lat["high"])}
    noise, cal = list(train.get("obs_noise_std", [0.0])), calibrated["obs_noise_std"]
    noise = noise * len(cal) if len(noise) == 1 else noise
    train["obs_noise_std"] = [max(a, b) for a, b in zip(noise, cal)]
    return data
