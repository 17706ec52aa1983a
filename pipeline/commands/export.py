"""`sim2real export RUN_DIR [--out DIR]`: a run's policy -> a parity-checked ONNX bundle (registered unless --out)."""

from __future__ import annotations

import argparse

from pipeline.commands import command, emit


@command("export")
def run(args: argparse.Namespace) -> int:
    from pipeline.deployment.export import export_policy
    from pipeline.evaluation.monitor_bounds import bundle_spec

    result = export_policy(
        args.run_dir, out_dir=args.out, registry_root=getattr(args, "registry", "models"), shield_spec=bundle_spec
    )
    where = f"registered as {result['task']} v{result['version']}" if result["version"] else "standalone bundle"
    emit(
        args,
        result,
        f"exported {result['bundle']} ({where}); parity max abs err "
        f"{result['parity_max_abs_err']:.2e} on {result['parity_observations']} observations",
    )
    return 0
