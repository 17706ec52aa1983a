"""Per-action latency of the exported policy (batch 1 and 64) beside torch, and what the edge session settings buy.

Measured in one run, on the same policy and observations:

- torch `DeterministicPolicy` (no_grad), the baseline;
- onnxruntime with the edge settings (`shield.policy.edge_session_options`: 1 thread,
  sequential, no spinning);
- onnxruntime with default session options (a thread pool whose workers spin);
- the edge runtime with the CBF shield (policy + shield per action), when the bundle has one.

Per call: p50/p99 wall latency (µs) and CPU time (µs, all threads of the process).
Then a 1 kHz control loop paced by deadlines, where the policy's spinning workers
show up as CPU burned while the loop waits: CPU% of one core over the loop.

    python bench/bench_policy_latency.py                 # 17-64-64-6 MLP (HalfCheetah-sized)
    python bench/bench_policy_latency.py --run runs/cartpole-20260101-120000 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.deployment.export import export_deterministic  # noqa: E402
from pipeline.training.model import ActorCritic, DeterministicPolicy  # noqa: E402
from shield.bundle import Bundle  # noqa: E402
from shield.policy import OnnxPolicy  # noqa: E402
from shield.runtime import EdgeRuntime  # noqa: E402


def per_call(fn, observations: np.ndarray, warmup: int = 200) -> dict:
    """Wall latency percentiles and mean CPU time per call (µs)."""
    for obs in observations[:warmup]:
        fn(obs)
    wall = np.empty(len(observations))
    cpu0 = time.process_time()
    for i, obs in enumerate(observations):
        t0 = time.perf_counter_ns()
        fn(obs)
        wall[i] = time.perf_counter_ns() - t0
    cpu = (time.process_time() - cpu0) / len(observations) * 1e6
    return {
        "p50_us": float(np.percentile(wall, 50) / 1e3),
        "p99_us": float(np.percentile(wall, 99) / 1e3),
        "cpu_us_per_call": cpu,
    }


def control_loop_cpu(fn, observations: np.ndarray, rate_hz: float = 1000.0, seconds: float = 1.0) -> float:
    """CPU% (of one core, all threads) of a deadline-paced loop calling `fn` at `rate_hz`."""
    period = 1.0 / rate_hz
    steps = int(seconds * rate_hz)
    cpu0, start = time.process_time(), time.perf_counter()
    deadline = start
    for i in range(steps):
        fn(observations[i % len(observations)])
        deadline += period
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    return 100.0 * (time.process_time() - cpu0) / (time.perf_counter() - start)


def _demo_policy(obs_dim: int = 17, act_dim: int = 6) -> tuple[DeterministicPolicy, dict, dict]:
    """A random 64x64 policy with a non-trivial normalizer, its meta and a minimal valid shield spec."""
    torch.manual_seed(0)
    ac = ActorCritic(obs_dim, act_dim, (64, 64))
    ac.obs_rms.update(torch.randn(4096, obs_dim, dtype=torch.float64) * 2.0 + 0.5)
    meta = dict(task="bench", env_id="HalfCheetah-v5", updates=0, env_steps=0, **ac.spec())
    # obs[0]/obs[1] taken as a position/velocity pair on a 100 m rail: the shield runs but rarely acts.
    spec = {
        "schema_version": 1,
        "task": "bench",
        "obs_dim": obs_dim,
        "act_dim": act_dim,
        "dt": 0.05,
        "action_low": [-1.0] * act_dim,
        "action_high": [1.0] * act_dim,
        "state_index": [0, 1],
        "model": {"type": "double_integrator", "accel_per_action": [[1.0] + [0.0] * (act_dim - 1)]},
        "kinematics": {"position_index": [0], "velocity_index": [1], "brake_accel": [1.0]},
        "constraints": [{"name": "rail", "type": "box", "index": [0], "low": [-50.0], "high": [50.0]}],
    }
    return DeterministicPolicy(ac), meta, spec


def _run_policy(run_dir: str) -> tuple[DeterministicPolicy, dict, dict]:
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec
    from pipeline.training.policy import load_policy

    policy, meta = load_policy(run_dir)
    return policy, meta, build_shield_spec(load_config(Path(run_dir) / "config.yaml"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="training run directory (default: a random 17-64-64-6 policy)")
    parser.add_argument("--calls", type=int, default=20_000, help="timed calls per variant")
    parser.add_argument("--loop-seconds", type=float, default=1.0, help="length of each 1 kHz control-loop run (s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    policy, meta, spec = _run_policy(args.run) if args.run else _demo_policy()
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_deterministic(
            policy,
            meta,
            spec,
            config_hash=meta.get("config_hash", "bench"),
            out_dir=Path(tmp) / "bundle",
            registry_root=Path(tmp) / "models",
        )
        bundle = Bundle.load(exported["bundle"])
        runtime = EdgeRuntime.load(exported["bundle"])
    edge = OnnxPolicy(bundle.policy_onnx)
    default = OnnxPolicy(bundle.policy_onnx, edge=False)
    rng = np.random.default_rng(0)

    def observations(n: int, batch: int) -> np.ndarray:
        raw = policy.obs_mean.numpy() + policy.obs_std.numpy() * rng.standard_normal((n, batch, edge.obs_dim))
        return raw.astype(np.float32)

    def torch_call(o):
        with torch.no_grad():
            return policy(torch.from_numpy(o)).numpy()

    callables = {"torch": torch_call, "onnx_edge": edge, "onnx_default_options": default}
    results = {}
    for batch, calls in ((1, args.calls), (64, max(args.calls // 10, 100))):
        obs = observations(calls, batch)
        for name, fn in callables.items():
            results[f"{name}_b{batch}"] = per_call(fn, obs)
            results[f"{name}_b{batch}"]["loop_1khz_cpu_percent"] = control_loop_cpu(fn, obs, seconds=args.loop_seconds)
        if batch == 1:
            results["edge_runtime_shielded_b1"] = per_call(lambda o: runtime.act(o[0]), obs)
    base, e, d = results["torch_b1"], results["onnx_edge_b1"], results["onnx_default_options_b1"]
    e64, d64 = results["onnx_edge_b64"], results["onnx_default_options_b64"]
    summary = {
        "policy": f"{edge.obs_dim}-{'-'.join(map(str, meta['hidden_sizes']))}-{edge.act_dim}",
        "torch_threads": torch.get_num_threads(),
        "calls": args.calls,
        "parity_max_abs_err": exported["parity_max_abs_err"],
        "speedup_p50_onnx_edge_vs_torch_b1": base["p50_us"] / e["p50_us"],
        "cpu_per_call_default_vs_edge_b1": d["cpu_us_per_call"] / e["cpu_us_per_call"],
        "cpu_per_call_default_vs_edge_b64": d64["cpu_us_per_call"] / e64["cpu_us_per_call"],
        "loop_cpu_default_vs_edge_b1": d["loop_1khz_cpu_percent"] / max(e["loop_1khz_cpu_percent"], 1e-9),
        "loop_cpu_default_vs_edge_b64": d64["loop_1khz_cpu_percent"] / max(e64["loop_1khz_cpu_percent"], 1e-9),
        "variants": results,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"policy {summary['policy']}, {args.calls} calls per variant at batch 1 (1/10 at batch 64) (torch threads: "
        f"{summary['torch_threads']}); "
        f"parity {summary['parity_max_abs_err']:.1e}"
    )
    print(f"{'variant':<28} {'p50 µs':>8} {'p99 µs':>8} {'CPU µs/call':>12} {'1 kHz loop CPU%':>16}")
    for name, r in results.items():
        loop = f"{r['loop_1khz_cpu_percent']:.1f}" if "loop_1khz_cpu_percent" in r else "-"
        print(f"{name:<28} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f} {r['cpu_us_per_call']:>12.1f} {loop:>16}")
    print(f"onnx (edge) vs torch at batch 1, p50: {summary['speedup_p50_onnx_edge_vs_torch_b1']:.1f}x faster")
    for b in (1, 64):
        print(
            f"default vs edge session options at batch {b}: {summary[f'cpu_per_call_default_vs_edge_b{b}']:.1f}x CPU "
            f"per call, {summary[f'loop_cpu_default_vs_edge_b{b}']:.1f}x CPU in a 1 kHz loop"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
