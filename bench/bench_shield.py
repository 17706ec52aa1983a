"""Per-action latency of policy + CBF shield beside the policy alone, and how often the shield intervenes.

    python bench/bench_shield.py [--task cartpole|quadrotor] [--steps 3000] [--episodes 5]
    python bench/bench_shield.py --task quadrotor --steps 20000 --realtime --cpu 1   # as `serve --realtime --cpu 1`

The policy is the edge runtime's `OnnxPolicy` (onnxruntime, 1 thread, no
spinning; one plant's call through its preallocated binding) of a 64-64 tanh
MLP built with onnx.helper (random weights: latency does not depend on them).
States come from the legacy controller flying the task's
`reality` domains, so the shield sees realistic observations. The intervention
share is measured for the legacy controller driving with the shield in the
loop (no trained policy is needed for this figure). The spec is the one a bundle
carries (its monitor's bounds measured): on the recorded states another policy's
actions did not cause the transitions that follow, so its monitor flags them and the
shield runs conservative there; those sources' shares are timing inputs, not a plant's.
Shielded figures are also
split into safe steps (the action passes unchanged, no QP) and intervening
steps (the QP runs), with actions from the MLP, the task's adversary and
full-scale random inputs (bang-bang); the adversary's actions are also timed
through the shield alone, which splits a step's cost into the shield's and
what the policy call adds (its own time, and the caches it leaves cold).
A history policy (`--history H`, its state an explicit input and output of the graph, exported by
`pipeline.deployment.export.to_onnx`) is timed beside the memoryless MLP, alone and shielded, each step
as a plant session runs it: `act` with the plant's memory, the shield, `remember` the action sent.
Figures are percentiles on a noisy shared machine: read the ratios. The variants take turns over 20 chunks of
the recorded steps, so a noisy spell hits all of them and the policy-alone
baseline alike. As in `serve`, the cyclic GC is frozen after
loading; `--realtime` also takes what `serve --realtime` takes (SCHED_FIFO,
mlockall, `--cpu`), so the tail is the code's rather than the neighbours'.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp_onnx(obs_dim: int, act_dim: int, hidden: int = 64, seed: int = 0) -> bytes:
    """A obs -> 64 -> 64 -> act tanh MLP as ONNX bytes."""
    rng = np.random.default_rng(seed)
    sizes = [obs_dim, hidden, hidden, act_dim]
    inits, nodes, x = [], [], "obs"
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}")]
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Tanh", [f"a{i}"], [f"h{i}"]),
        ]
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, [None, obs_dim])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [None, act_dim])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # what onnxruntime 1.18+ loads; onnx's default can be newer than the runtime
    onnx.checker.check_model(model)
    return model.SerializeToString()


def history_policy_onnx(obs_dim: int, act_dim: int, history_length: int) -> bytes:
    """A 64-64 tanh policy over the observation and its last `history_length` (observation, action) pairs, with
    the history an explicit input and output, exported as `sim2real export` exports one (untrained weights)."""
    import torch

    from pipeline.deployment.export import to_onnx
    from pipeline.training.model import ActorCritic, DeterministicPolicy

    torch.manual_seed(0)
    ones = [1.0] * act_dim
    ac = ActorCritic(obs_dim, act_dim, (64, 64), [-v for v in ones], ones, history_length=history_length)
    return to_onnx(DeterministicPolicy(ac), obs_dim, {}).SerializeToString()


def recorded_observations(cfg, steps: int) -> np.ndarray:
    """Observations of the legacy controller flying `reality` domains (float32[steps, obs_dim])."""
    import gymnasium as gym

    import envs

    env = gym.make(cfg.task.env_id, randomization="reality")
    policy = envs.legacy_controller(cfg.task.env_id)
    out, seed = [], 0
    obs, _ = env.reset(seed=seed)
    while len(out) < steps:
        out.append(obs)
        obs, _, terminated, truncated, _ = env.step(policy(obs[None])[0])
        if terminated or truncated:
            seed += 1
            obs, _ = env.reset(seed=seed)
    env.close()
    return np.asarray(out, np.float32)


CHUNKS = 20  # turns per variant (see main)


def percentiles(us) -> dict:
    a = np.asarray(us)
    return {
        "p50_us": round(float(np.percentile(a, 50)), 2),
        "p99_us": round(float(np.percentile(a, 99)), 2),
        "steps": int(a.size),
    }


def main() -> None:
    """Print the latency and intervention figures as one JSON object (and a readable summary on stderr)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="cartpole", help="task name: configs/<task>.yaml (any declared task)")
    parser.add_argument("--steps", type=int, default=3000, help="timed actions per variant")
    parser.add_argument("--episodes", type=int, default=5, help="legacy episodes for the intervention share")
    parser.add_argument(
        "--bundle",
        help="a trained bundle: also report its intervention share driving nominal "
        "and reality domains (e.g. models/cartpole/1 after `sim2real run`)",
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="time under SCHED_FIFO with memory locked, as `serve --realtime` runs (needs root or "
        "CAP_SYS_NICE; what is not permitted is said and skipped)",
    )
    parser.add_argument("--cpu", type=int, help="with --realtime: pin to this CPU, as `serve --cpu`")
    parser.add_argument("--history", type=int, default=4, help="history length of the stateful policy timed")
    args = parser.parse_args()

    from pipeline.config import load_config
    from pipeline.evaluation.evaluate import evaluate, reference_policy
    from pipeline.evaluation.monitor_bounds import bundle_spec
    from shield.cbf import CbfShield
    from shield.policy import OnnxPolicy
    from shield.spec import ShieldSpec

    cfg = load_config(f"configs/{args.task}.yaml")
    spec = ShieldSpec.from_dict(bundle_spec(cfg))  # what a bundle carries: the monitor's bounds measured
    policy = OnnxPolicy(mlp_onnx(spec.obs_dim, spec.act_dim))  # what `EdgeRuntime` runs: one plant's `act`
    # Both exported by `to_onnx` (normalization and clipping in the graph): the memoryless one and the history one.
    exported = OnnxPolicy(history_policy_onnx(spec.obs_dim, spec.act_dim, 0))
    stateful_policy = OnnxPolicy(history_policy_onnx(spec.obs_dim, spec.act_dim, args.history))
    memory = stateful_policy.new_memory()
    observations = recorded_observations(cfg, args.steps)
    adversary = reference_policy("adversarial", cfg, spec)

    pushes = adversary(observations)  # precomputed: only the policy and the shield are timed
    # Full-scale random inputs (+-1 per input): most steps need the QP, on every task.
    bang_bang = np.random.default_rng(0).choice([-1.0, 1.0], size=(len(observations), spec.act_dim))
    bang_bang = (np.where(bang_bang > 0, spec.action_high, spec.action_low)).astype(np.float32)

    problems = []
    if args.realtime:
        from shield.serve_cli import go_realtime

        problems = go_realtime(args.cpu)
        for problem in problems:
            print(f"--realtime: not permitted: {problem}; timing without it", file=sys.stderr)
    gc.collect()
    gc.freeze()  # what `serve` does once its bundle is loaded

    def variant(with_shield: bool, actions: np.ndarray | None = None, with_policy: bool = True, net=(policy, None)):
        """Times policy (+ shield) over a range of the observations per call; its shield keeps its state between.
        `with_policy=False`: the shield alone on `actions` (no policy call), to split the step's cost.
        `net`: (policy, its plant memory or None); the action sent is remembered each step, as a session does."""
        net_policy, net_memory = net
        shield = CbfShield(spec)
        times, intervened = [], []

        def run(indices: range) -> None:
            for i in indices:
                obs = observations[i]
                t0 = time.perf_counter()
                if with_policy:
                    raw = net_policy.act(obs, net_memory)
                if actions is not None:  # the adversary's action in place of the MLP's: the QP runs often
                    raw = actions[i]
                sent = raw
                if with_shield:
                    sent, info = shield.filter(obs, raw)
                    intervened.append(info["intervened"])
                else:
                    intervened.append(False)
                net_policy.remember(net_memory, obs, sent)
                times.append((time.perf_counter() - t0) * 1e6)

        def figures() -> tuple[dict, float]:
            # The first steps warm caches up; then split by what the shield did, since an
            # intervention runs the QP and a safe action does not.
            t, hit = np.asarray(times[50:]), np.asarray(intervened[50:], bool)
            out = percentiles(t)
            if with_shield:
                out["safe_steps"] = percentiles(t[~hit]) if (~hit).any() else None
                out["intervening_steps"] = percentiles(t[hit]) if hit.any() else None
            return out, float(np.mean(intervened))

        return run, figures

    # The variants take turns over chunks of the recorded steps (each its own shield, in order), so a noisy
    # spell of the machine lands on all of them and on the baseline alike, not on whichever ran then.
    variants = [
        variant(False),
        variant(True),
        variant(True, pushes),
        variant(True, bang_bang),
        variant(True, pushes, with_policy=False),
        variant(False, net=(exported, None)),
        variant(True, net=(exported, None)),
        variant(False, net=(stateful_policy, memory)),
        variant(True, net=(stateful_policy, memory)),
    ]
    chunk = max(1, len(observations) // CHUNKS)
    for lo in range(0, len(observations), chunk):
        for run, _ in variants:
            run(range(lo, min(lo + chunk, len(observations))))
    (
        (policy_only, _),
        (shielded, share_mlp),
        (adversarial, share_adv),
        (banged, share_bang),
        (shield_only, _),
        (exported_only, _),
        (exported_shielded, _),
        (stateful_only, _),
        (stateful_shielded, _),
    ) = (figures() for _, figures in variants)
    legacy = evaluate(
        cfg,
        reference_policy("legacy", cfg, spec),
        domains="reality",
        episodes=args.episodes,
        seed=0,
        shield=True,
        spec=spec,
    )
    result = {
        "task": args.task,
        "timed_actions": args.steps,
        "realtime": args.realtime,
        "realtime_not_permitted": problems,
        "cpu": args.cpu,
        "policy_alone": policy_only,
        "policy_plus_shield": shielded,
        "ratio_p50": round(shielded["p50_us"] / policy_only["p50_us"], 2),
        "ratio_p99": round(shielded["p99_us"] / policy_only["p99_us"], 2),
        "policy_plus_shield_adversarial_actions": adversarial,
        "policy_plus_shield_bang_bang_actions": banged,
        "shield_alone_adversarial_actions": shield_only,
        "history_length": args.history,
        "exported_memoryless_alone": exported_only,
        "exported_memoryless_plus_shield": exported_shielded,
        "stateful_policy_alone": stateful_only,
        "stateful_policy_plus_shield": stateful_shielded,
        "intervention_share_random_mlp": round(share_mlp, 4),
        "intervention_share_adversarial": round(share_adv, 4),
        "intervention_share_bang_bang": round(share_bang, 4),
        "intervention_share_legacy_in_loop": round(legacy["intervention_rate"], 4),
        "legacy_in_loop_violations": legacy["violations"],
        "legacy_in_loop_shield_us": {
            "p50_us": round(legacy["shield_us_p50"], 2),
            "p99_us": round(legacy["shield_us_p99"], 2),
        },
    }
    if args.bundle:
        from shield.runtime import EdgeRuntime

        trained = EdgeRuntime.load(args.bundle, shield=False)  # evaluate() applies the shield itself
        for domains in ("nominal", "reality"):
            run_ = evaluate(cfg, trained, domains=domains, episodes=args.episodes, seed=0, shield=True, spec=spec)
            result[f"intervention_share_trained_{domains}"] = round(run_["intervention_rate"], 4)
            result[f"trained_{domains}_violations"] = run_["violations"]
            print(
                f"trained policy ({args.bundle}) on {domains} domains: shield intervened on "
                f"{run_['intervention_rate']:.2%} of {run_['steps']} steps, {run_['violations']} violations",
                file=sys.stderr,
            )
    print(json.dumps(result))
    base = policy_only["p50_us"], policy_only["p99_us"]
    print(f"policy alone: p50 {base[0]:.1f} us, p99 {base[1]:.1f} us", file=sys.stderr)
    for name, alone in (("exported memoryless", exported_only), (f"history-{args.history}", stateful_only)):
        print(f"{name} policy alone: p50 {alone['p50_us']:.1f} us, p99 {alone['p99_us']:.1f} us", file=sys.stderr)
    for name, figures in (
        ("policy + shield, mlp", shielded),
        ("policy + shield, adversary", adversarial),
        ("policy + shield, bang-bang", banged),
        ("shield alone, adversary", shield_only),
        ("exported memoryless policy + shield", exported_shielded),
        (f"history-{args.history} policy + shield", stateful_shielded),
    ):
        for part in ("safe_steps", "intervening_steps"):
            f = figures.get(part)
            if f:
                print(
                    f"{name} actions, {part.replace('_', ' ')} ({f['steps']}): p50 {f['p50_us']:.1f} us "
                    f"(x{f['p50_us'] / base[0]:.1f}), p99 {f['p99_us']:.1f} us (x{f['p99_us'] / base[1]:.1f})",
                    file=sys.stderr,
                )


if __name__ == "__main__":
    main()
