"""`sim2real schedule`: put the retrain flow on a cron schedule.

Two ways to run the scheduled flows, both against the ephemeral API or the
server at PREFECT_API_URL:
- `--serve`: this process creates the deployment and runs its flow runs itself
  (Prefect's `flow.serve`), until stopped. Simplest on one machine.
- default: the deployment goes to a `process` work pool (created if missing);
  start a worker from the repository root with
  `prefect worker start --pool sim2real-process`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.schedules import Cron

from flows.retrain import retrain
from pipeline.config import load_config

WORK_POOL = "sim2real-process"


async def ensure_work_pool(name: str = WORK_POOL) -> None:
    """Create the process work pool the deployment runs on, if it doesn't exist yet."""
    async with get_client() as client:
        try:
            await client.read_work_pool(name)
        except ObjectNotFound:
            await client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def schedule(
    config_path: str,
    cron: str,
    name: str | None = None,
    timezone: str = "UTC",
    serve: bool = False,
    *,
    models_root: str = "models",
    runs_dir: str = "runs",
    steps: int | None = None,
    ray_address: str | None = None,
    from_log: str | None = None,
) -> dict:
    """Create (or update) the cron deployment of the retrain flow; returns its id, schedule and parameters.

    The parameters are `retrain`'s (`sim2real run`'s options). `from_log`: the field shadow logs every
    scheduled run calibrates the twin to first, a file or a directory the plant's `serve --mode shadow`
    keeps writing to: each night's run reads what is there by then. Stored as an absolute path, so the
    worker's working directory does not change which logs it reads.
    """
    cfg = load_config(config_path)  # a bad config fails here, not at 3 a.m.
    if from_log is not None and not Path(from_log).exists():  # nor do logs that are not there
        raise FileNotFoundError(f"--from-log {from_log}: no such file or directory")
    name = name or f"retrain-{cfg.task.name}"
    parameters = {"config_path": str(Path(config_path)), "models_root": models_root, "runs_dir": runs_dir}
    extra = {
        "steps": steps,
        "ray_address": ray_address,
        "from_log": str(Path(from_log).resolve()) if from_log is not None else None,
    }
    parameters.update({k: v for k, v in extra.items() if v is not None})
    when = Cron(cron, timezone=timezone)
    if serve:
        retrain.serve(name=name, schedule=when, parameters=parameters)  # blocks, running scheduled runs
        return {"deployment": name, "cron": cron, "served": True, "parameters": parameters}
    asyncio.run(ensure_work_pool())
    deployment = retrain.to_deployment(
        name=name, schedule=when, parameters=parameters, description=f"nightly retrain of {cfg.task.name}"
    )
    deployment_id = deployment.apply(work_pool_name=WORK_POOL)
    return {
        "deployment": f"retrain/{name}",
        "deployment_id": str(deployment_id),
        "cron": cron,
        "timezone": timezone,
        "work_pool": WORK_POOL,
        "parameters": parameters,
        "api": os.environ.get("PREFECT_API_URL", "ephemeral"),
    }
