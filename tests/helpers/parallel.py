"""Independent, seeded evaluations spread over the machine's cores.

The suite runs one test at a time, so a test that loops over hundreds of independent episodes (every corner of an
envelope) leaves all but one core idle; CI has two. `map_in_processes` runs the same calls, with the same
arguments and seeds, in a pool of fresh ("spawn") processes and returns their results in the order given: the
episodes, and what the test asserts on them, are the ones the serial loop ran; only the wall time changes.
`SIM2REAL_TEST_WORKERS=1` runs them in the test's own process (to debug one, or to compare).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    wanted = int(os.environ.get("SIM2REAL_TEST_WORKERS", "0") or 0)
    return max(1, min(cores, wanted) if wanted > 0 else cores)


@contextmanager
def process_pool() -> Iterator[Executor | None]:
    """One pool for a module's tests (a worker starts once, not once per test); None where there is one core."""
    n = workers()
    if n <= 1:
        yield None
        return
    # spawn, not fork: the test process may hold Ray, torch and Prefect threads that a fork would copy mid-state.
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def map_in_processes(pool: Executor | None, fn: Callable[[T], R], items: Iterable[T], chunksize: int = 4) -> list[R]:
    """`[fn(x) for x in items]`, on `pool` (in this process without one); `fn` is pickled: a module-level function."""
    items = list(items)
    if pool is None or len(items) <= 1:
        return [fn(x) for x in items]
    return list(pool.map(fn, items, chunksize=chunksize))
