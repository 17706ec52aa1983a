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


def schedule(config_path: str, cron: str, name: str | None = None, timezone: str = "UTC",
             serve: bool = False) -> dict:
    """Create (or update) the cron deployment of the retrain flow; returns its id and schedule."""
    cfg = load_config(config_path)  # a bad config fails here, not at 3 a.m.
    name = name or f"retrain-{cfg.task.name}"
    parameters = {"config_path": str(Path(config_path)), "models_root": "models", "runs_dir": "runs"}
    when = Cron(cron, timezone=timezone)
    if serve:
        retrain.serve(name=name, schedule=when, parameters=parameters)  # blocks, running scheduled runs
        return {"deployment": name, "cron": cron, "served": True}
    asyncio.run(ensure_work_pool())
    deployment = retrain.to_deployment(name=name, schedule=when, parameters=parameters,
                                       description=f"nightly retrain of {cfg.task.name}")
    deployment_id = deployment.apply(work_pool_name=WORK_POOL)
    return {"deployment": f"retrain/{name}", "deployment_id": str(deployment_id), "cron": cron,
            "timezone": timezone, "work_pool": WORK_POOL,
            "api": os.environ.get("PREFECT_API_URL", "ephemeral")}
