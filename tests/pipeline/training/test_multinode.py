"""Off-policy training on a real multi-node Ray cluster, with a worker node killed mid-run.

`ray.cluster_utils.Cluster` starts a head and two worker nodes on this machine,
each a separate raylet with its own object store and worker processes (2
logical CPUs each, so the survivors have room for the restarts: NOTES.md).
Actors (0.5 CPU) and replay shards (0.25 CPU) are spread over the nodes;
the weight source stays on the driver's (head) node. Once learning is under
way, a worker node that hosts an actor or a shard is removed (its raylet and
every process on it are killed). The run must finish its step budget on the
remaining nodes, with the lost actors and shards restarted and counted.
"""

import pytest
import ray
from ray.cluster_utils import Cluster

from pipeline.training.actor_pool import ray_for_run
from pipeline.training.train import train
from tests.pipeline.training.test_offpolicy import read_metrics, sac_config


@pytest.fixture
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2))
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.timeout(420)
def test_run_survives_losing_a_worker_node(cluster, tmp_path):
    cluster, workers = cluster
    head_id = ray.get_runtime_context().get_node_id()
    cfg = sac_config(learning_starts=500, replay_ratio=8.0, log_every=10, checkpoint_every=10_000)
    cfg.train.num_actors, cfg.train.replay.num_shards = 2, 2
    cfg.ray.max_actor_restarts = 5
    killed = {}

    def kill_a_busy_worker(state):
        if killed or state["updates"] < 20:
            return
        hosting = set(state["nodes"]["actors"]) | set(state["nodes"]["shards"])
        victims = [w for w in workers if w.node_id in hosting]
        if victims:
            killed.update(
                node=victims[0].node_id,
                actors=victims[0].node_id in state["nodes"]["actors"],
                shards=victims[0].node_id in state["nodes"]["shards"],
                env_steps=state["env_steps"],
            )
            cluster.remove_node(victims[0])

    steps = 6_000
    result = train(cfg, out_dir=tmp_path / "run", steps=steps, progress=False, callback=kill_a_busy_worker)
    assert killed, f"no worker node hosted an actor or shard: {result.replay.nodes}"
    assert killed["env_steps"] < steps  # the kill happened mid-run
    used = set(result.replay.nodes["actors"]) | set(result.replay.nodes["shards"])
    assert len(used) >= 2 and used - {head_id}, result.replay.nodes  # spread over nodes, workers included
    assert result.env_steps >= steps
    if killed["actors"]:
        assert result.actor_restarts >= 1, (killed, result)
    if killed["shards"]:
        assert result.replay.shard_restarts >= 1, (killed, result)
    assert result.actor_restarts + result.replay.shard_restarts >= 1
    last = read_metrics(result.run_dir)[-1]
    assert last["actor_restarts"] == result.actor_restarts and last["shard_restarts"] == result.replay.shard_restarts
    assert last["replay_shards_up"] == cfg.train.replay.num_shards  # restarted shards answer again
    assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == killed["node"])  # really gone


@pytest.mark.timeout(180)
def test_a_run_without_an_address_starts_its_own_ray_beside_a_cluster_on_this_machine():
    """A cluster started on this machine (`ray start`, or a test's) leaves its address in /tmp/ray, which a bare
    `ray.init()` joins: a run given no address must start the local instance the docs promise instead."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1))
    try:
        with ray_for_run(None, 1):
            assert ray.get_runtime_context().gcs_address != cluster.address
    finally:
        cluster.shutdown()
