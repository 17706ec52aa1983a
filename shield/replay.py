"""Per-client state of `sim2real serve`: the sequence guard (replay protection) and the plant table.

Both are bounded (least recently seen first out) and both change only for a request
that is accepted: authenticated when the server has a key, well-formed and fresh.
Nothing an unauthenticated or malformed datagram carries can evict an entry.

Sequence numbers with a key (README.md, "Keys, sequence numbers and replays"):
a request is fresh when its `seq`

* lies within `window_us` of the server's wall clock (a captured packet is useless
  once its time has passed, so the guard need not remember it for ever),
* is above `not_before_us` (the server's start plus the window: nothing accepted by
  an earlier run of the server can be accepted again after a restart),
* is above the client's last accepted `seq`, or, for a client the guard no longer
  remembers, above the highest `seq` it ever forgot (a forgotten client's packets
  stay refused, however many other ids pass).

Clients set `seq = max(last + 1, now_us)` (wall clock, µs). Without a key, anyone
can forge any `seq`: the guard then only keeps late and duplicated packets from
running the policy, per (source address, client_id).

Stdlib only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable


class SequenceGuard:
    """Last accepted `seq` per client; `fresh` only looks, `commit` remembers."""

    def __init__(self, capacity: int = 4096, *, window_us: int | None = None, not_before_us: int = 0):
        self.capacity, self.window_us = capacity, window_us
        self.not_before_us = not_before_us
        self.forgotten_max = 0  # highest seq of a client evicted from the table
        self._last: OrderedDict[Any, int] = OrderedDict()

    def fresh(self, client: Any, seq: int, now_us: int) -> bool:
        """True when `seq` may be accepted from `client` now (no state changes)."""
        window = self.window_us
        if window is not None and not (now_us - window <= seq <= now_us + window and seq > self.not_before_us):
            return False
        last = self._last.get(client)
        if last is None:
            return window is None or seq > self.forgotten_max
        return seq > last

    def commit(self, client: Any, seq: int) -> None:
        """Remember `seq` as `client`'s last (call only for an accepted request)."""
        last = self._last
        last[client] = seq
        last.move_to_end(client)
        if len(last) > self.capacity:
            _, old = last.popitem(last=False)
            if old > self.forgotten_max:
                self.forgotten_max = old

    def __len__(self) -> int:
        return len(self._last)

    def snapshot(self) -> tuple:
        """Everything that decides what is fresh (for tests: unchanged by a refused datagram)."""
        return tuple(self._last.items()), self.forgotten_max, self.not_before_us


class PlantTable:
    """One session per plant (client), at most `capacity`; the least recently seen is evicted to admit a new one."""

    def __init__(self, capacity: int, factory: Callable[[], Any]):
        if capacity < 1:
            raise ValueError(f"max plants must be >= 1, got {capacity}")
        self.capacity, self.factory = capacity, factory
        self.sessions: OrderedDict[Any, Any] = OrderedDict()
        self.created = self.evicted = 0

    def get(self, client: Any) -> Any:
        """The client's session, created (and the oldest evicted past capacity) on first use."""
        sessions = self.sessions
        session = sessions.get(client)
        if session is None:
            session = sessions[client] = self.factory()
            session.episode = self.created  # the shadow log numbers plants in order of appearance
            self.created += 1
            if len(sessions) > self.capacity:
                sessions.popitem(last=False)
                self.evicted += 1
        else:
            sessions.move_to_end(client)
        return session

    def __len__(self) -> int:
        return len(self.sessions)
