"""Per-client state of `sim2real serve`: the sequence guard (replay protection) and the plant table.

Both are bounded and both change only for a request that is accepted: authenticated
when the server has a key, well-formed and fresh. Nothing an unauthenticated or
malformed datagram carries can evict an entry; the guard forgets the least recently
seen client first, the plant table never forgets a live plant (`PlantTable`).

Sequence numbers with a key (docs/reference/protocol.md, "Keys, sequence numbers and replays"):
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
from collections.abc import Callable
from typing import Any


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
        """Remember `seq` as `client`'s last: with a key, for every authenticated fresh request whatever the
        answer; without one, for an accepted request only."""
        last = self._last
        last[client] = seq
        last.move_to_end(client)
        if len(last) > self.capacity:
            _, old = last.popitem(last=False)
            if old > self.forgotten_max:
                self.forgotten_max = old

    def last(self, client: Any) -> int:
        """`client`'s last remembered `seq` (-1 when it is not remembered)."""
        return self._last.get(client, -1)

    def __len__(self) -> int:
        return len(self._last)

    def snapshot(self) -> tuple:
        """Everything that decides what is fresh (for tests: unchanged by a refused datagram)."""
        return tuple(self._last.items()), self.forgotten_max, self.not_before_us


class PlantTable:
    """One session per plant (client), at most `capacity`.

    A new plant takes the place of the least recently seen one only when that one has been
    silent for `live_ns`; otherwise it is refused (`admit` returns None). Dropping a live
    plant's session would make its shield forget the actions still in flight to it, which is
    exactly what keeps it inside its constraints through the latency: so no sender, however
    many client ids it makes up, and no 65th honest plant, can take a live plant's state away.
    A plant silent that long has applied nothing but its own fallback for longer than its
    latency: a fresh session (pending actions = the fallback) predicts it right.
    """

    def __init__(self, capacity: int, factory: Callable[[], Any], live_ns: int):
        if capacity < 1:
            raise ValueError(f"max plants must be >= 1, got {capacity}")
        self.capacity, self.factory, self.live_ns = capacity, factory, live_ns
        self.sessions: OrderedDict[Any, Any] = OrderedDict()
        self.created = self.evicted = self.refused = 0
        self.episodes = 0  # shadow-log episodes numbered so far, over every plant

    def admit(self, client: Any, seq: int, now_ns: int) -> Any:
        """The session for `client`'s accepted request `seq` at `now_ns`, created on first use (the oldest
        evicted when it has been silent for `live_ns`); None when every session is held by a live plant."""
        sessions = self.sessions
        session = sessions.get(client)
        if session is None:
            if len(sessions) >= self.capacity:
                oldest = next(iter(sessions.values()))
                if not self.lapsed(oldest, now_ns):
                    self.refused += 1
                    return None
                sessions.popitem(last=False)
                self.evicted += 1
            session = sessions[client] = self.factory()
            self.created += 1
            self.new_episode(session)
        else:
            sessions.move_to_end(client)
        session.seq, session.seen_ns = seq, now_ns
        return session

    def new_episode(self, session: Any) -> None:
        """The shadow log's next episode starts at this session's next step: a new plant, or a plant that said it
        was reset (RESET_STATE). Numbers are unique over plants, in order of appearance."""
        session.episode, session.step = self.episodes, 0
        self.episodes += 1

    def last_seq(self, client: Any) -> int:
        """The seq of the client's last accepted act request (-1 without a session): however many other
        ids pass through the sequence guard, a live plant's own session still refuses its old packets."""
        session = self.sessions.get(client)
        return -1 if session is None else session.seq

    def lapsed(self, session: Any, now_ns: int) -> bool:
        """Whether a plant's session has been silent for `live_ns` at `now_ns`: the one test of a silent plant, for
        its eviction, its policy state's reset, its restart and its estimate alike."""
        return now_ns - session.seen_ns >= self.live_ns

    def silent(self, client: Any, now_ns: int) -> bool:
        """Whether `client` has no session, or one that has lapsed at `now_ns`."""
        session = self.sessions.get(client)
        return session is None or self.lapsed(session, now_ns)

    def forget(self, client: Any) -> None:
        """Drop `client`'s session (a restarted plant's: its next request makes a new one)."""
        self.sessions.pop(client, None)

    def __len__(self) -> int:
        return len(self.sessions)
