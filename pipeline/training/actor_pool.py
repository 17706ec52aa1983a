"""The rollout actors as the driver sees them: requests in flight, back-pressure, deaths and restarts;
and the weight source they take the newest policy from.

Ray restarts a dead actor (`max_restarts`); requests that were in flight when
it died fail and are simply requested again. A restart is counted when a batch
arrives from a new life of an actor (each life has its own id), so restarts are
counted even when no request happened to be in flight at the time of death; a
life Ray reconstructed counts even when the driver never heard from the life
before it (an actor killed while still booting, on a loaded machine).
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from contextlib import contextmanager

import ray
from ray.exceptions import ActorUnavailableError, RayActorError


@contextmanager
def ray_for_run(address: str | None, num_cpus: float):
    """Ray for one training run: started here (a local instance with `num_cpus`, or joined at `address`)
    unless the caller already has it up, and shut down however the run ends, a failure while its actors
    start included. A Ray the caller started stays up (tests, a notebook)."""
    import signal

    from pipeline.training.learner import usable_cpus  # here: this module's actors import only Ray

    started = not ray.is_initialized()
    before = signal.getsignal(signal.SIGTERM)
    if started:
        _quiet_token_auth_notice()
        ray.init(
            # "local", not None: None would join a cluster `ray start` (or a test's) left in /tmp/ray on this
            # machine, which is not the instance the docs promise and refuses num_cpus.
            address=address or "local",
            num_cpus=None if address else max(usable_cpus(), math.ceil(num_cpus)),
            include_dashboard=False,
            log_to_driver=True,
        )
        _restore_sigterm(before)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
            _restore_sigterm(before)


def _restore_sigterm(handler) -> None:
    """Put back the SIGTERM handler the command had (`sim2real` turns SIGTERM into an interrupt: "interrupted",
    exit 130, actors shut down): Ray's driver installs one of its own that aborts the process with a stack dump
    (exit 134), and its shutdown leaves the default (killed outright, the temporary Prefect server orphaned). Only
    the main thread may set a handler: elsewhere Ray's stays."""
    import signal
    import threading

    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


class _TokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _quiet_token_auth_notice() -> None:
    """Drop Ray's note, on every local start, that it turned token authentication on: that is the safe default
    and the README says so once. Its warning that authentication is off stays."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthNotice) for f in logger.filters):
        logger.addFilter(_TokenAuthNotice())


class WeightSource:
    """The newest published policy: (version, [ObjectRef of the state_dict]).

    Here, in a module that imports only Ray, so its worker process starts in a
    fraction of the time a rollout actor's (torch, MuJoCo) takes.

    The ref is wrapped in a list so Ray passes the reference itself instead of
    resolving it; an actor fetches the weights only when the version changed.
    """

    def __init__(self):
        self._version, self._ref = -1, None

    def publish(self, version: int, wrapped_ref: list) -> None:
        self._version, self._ref = version, wrapped_ref

    def latest(self) -> tuple[int, list | None]:
        return self._version, self._ref


# A restarting rollout actor that is still unavailable after this long is given up (s).
ACTOR_RESTART_TIMEOUT_S = 120.0


def ray_restarted() -> bool:
    """Inside a Ray actor's constructor: is this a life Ray rebuilt after the previous one died?"""
    with warnings.catch_warnings():  # Ray marks the property deprecated but offers no replacement
        warnings.simplefilter("ignore")
        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return False  # not an actor: e.g. a rollout stepped in the driver's own process
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


class Lives:
    """Restarts of N Ray actors, counted from the life id each report carries (actors, replay shards).

    A new life of actor i counts once: when it differs from the last life seen, or when Ray
    says it rebuilt it (`ray_restarted`) even though the life before it was never seen.
    """

    def __init__(self, n: int):
        self.last: list[str | None] = [None] * n
        self.restarts = 0
        self._counted: set[str] = set()

    def note(self, i: int, life: str, reconstructed: bool) -> int:
        """Record which life of actor i answered; 1 if it is a restart not counted yet."""
        new = life != self.last[i] and (reconstructed or self.last[i] is not None) and life not in self._counted
        self.last[i] = life
        if new:
            self._counted.add(life)
            self.restarts += 1
        return int(new)


class ActorPool:
    """Hands out batches from the rollout actors; `collect` (async) or `collect_all` (sync)."""

    def __init__(self, actors: list, max_in_flight: int):
        self.actors, self.max_in_flight = actors, max_in_flight
        self.alive = list(range(len(actors)))
        self.lives = Lives(len(actors))
        self._pending: dict = {}  # ObjectRef -> actor index
        self._failing_since = [0.0] * len(actors)  # first failed request of the current outage, or 0

    def start(self) -> None:
        """Async mode: fill the pipeline with `max_in_flight` requests, round robin."""
        for k in range(self.max_in_flight):
            self._request(self.alive[k % len(self.alive)])

    def collect(self, n: int) -> list[dict]:
        """Async mode: the next `n` batches as they arrive; each answered actor is asked for another."""
        batches: list[dict] = []
        while len(batches) < n:
            i, batch = self._next()
            if i in self.alive:
                self._request(i)  # before learning, so the actor works while the learner does
            if batch is not None:
                batches.append(batch)
        return batches

    def collect_all(self, weights: tuple[int, list]) -> list[dict]:
        """Sync mode: one batch from every live actor, all collected with `weights`."""
        for i in self.alive:
            self._request(i, weights)
        batches: list[dict] = []
        while self._pending:
            i, batch = self._next()
            if batch is None and i in self.alive:
                self._request(i, weights)
            elif batch is not None:
                batches.append(batch)
        # Arrival order is a race; actor order makes a seeded sync run repeat exactly.
        return sorted(batches, key=lambda b: b["actor"])

    def _request(self, i: int, weights=None) -> None:
        self._pending[self.actors[i].rollout.remote(weights)] = i

    def _next(self) -> tuple[int, dict | None]:
        """(actor index, batch) of the first request to finish; batch None when the actor died."""
        ready, _ = ray.wait(list(self._pending), num_returns=1)
        i = self._pending.pop(ready[0])
        try:
            batch = ray.get(ready[0])
        except RayActorError:
            # A restarting actor fails the requests that were in flight at its death (ActorDiedError)
            # and may refuse new ones while it boots (ActorUnavailableError); the caller asks again.
            # How many fail depends on how fast Ray notices the death, so only an outage that
            # outlasts a restart drops the actor: counting failures dropped actors mid-restart on
            # loaded machines, and their restarts then went uncounted.
            now = time.perf_counter()
            self._failing_since[i] = self._failing_since[i] or now
            if now - self._failing_since[i] > ACTOR_RESTART_TIMEOUT_S:
                self._drop(i, "did not come back (died and Ray did not restart it: ray.max_actor_restarts used up?)")
            time.sleep(0.05)  # don't spin while it boots
            return i, None
        self._failing_since[i] = 0.0
        self._note_life(i, batch["life"], bool(batch.get("reconstructed", False)))
        return i, batch

    @property
    def restarts(self) -> int:
        return self.lives.restarts

    def _note_life(self, i: int, life: str, reconstructed: bool) -> int:
        """Record which life of actor i answered; 1 if it is a restart not counted yet (see `Lives`)."""
        return self.lives.note(i, life, reconstructed)

    def settle(self, timeout_s: float = 60.0) -> int:
        """End of a run: ask every live actor which life answers, and count the restarts no batch showed yet.

        An actor whose node died after its last batch is restarted by Ray without any request
        of the run failing; without this it would go uncounted. A call that reaches the dead
        life fails once Ray notices the death (node health checks take seconds), so it is
        asked again until the new life answers or `timeout_s` passes. Returns the restarts added.
        """
        deadline = time.perf_counter() + timeout_s
        waiting, added = set(self.alive), 0
        while waiting and time.perf_counter() < deadline:
            for i in sorted(waiting):
                left = deadline - time.perf_counter()
                try:
                    life, reconstructed = ray.get(self.actors[i].life_info.remote(), timeout=max(left, 0.1))
                except (RayActorError, ActorUnavailableError):
                    time.sleep(0.2)  # the old life is gone and the new one is booting: ask again
                    continue
                except ray.exceptions.GetTimeoutError:
                    waiting.clear()
                    break
                waiting.discard(i)
                added += self._note_life(i, life, reconstructed)
        return added

    def _drop(self, i: int, why: str) -> None:
        if i in self.alive:
            self.alive.remove(i)
            print(f"sim2real train: rollout actor {i} {why}; continuing with {len(self.alive)}", file=sys.stderr)
        if not self.alive:
            raise RuntimeError(f"all {len(self.actors)} rollout actors are gone; see the Ray logs")

    def kill_all(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
