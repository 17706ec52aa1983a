"""Progress on stderr: a bar on a terminal; otherwise a plain line at each tenth of the way (a log file gets
whole lines, no carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

LINES = 10  # plain lines per run when stderr is not a terminal


class Progress:
    """`update_to(n, postfix)` / `update(k)` / `close()`, like a tqdm bar, which it is on a terminal."""

    def __init__(
        self,
        total: int,
        unit: str,
        desc: str = "",
        initial: int = 0,
        enabled: bool = True,
        stream: IO[str] | None = None,
    ):
        self.stream = stream or sys.stderr
        self.total, self.unit, self.desc, self.n, self.enabled = max(int(total), 1), unit, desc, int(initial), enabled
        self.postfix: dict[str, Any] = {}
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                unit=unit,
                file=self.stream,
                desc=desc or None,
                dynamic_ncols=True,
                smoothing=0.1,
            )
        self._tenth, self._printed = self._tenth_of(self.n), self.n
        self._start, self._n0 = time.perf_counter(), self.n

    def _tenth_of(self, n: int) -> int:
        return min(LINES, n * LINES // self.total)

    def update_to(self, n: int, postfix: dict[str, Any] | None = None) -> None:
        """Progress is now `n` of the total; `postfix`: figures shown beside it."""
        if postfix is not None:
            self.postfix = postfix
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            if postfix is not None:
                self.bar.set_postfix(postfix, refresh=False)
        elif self.enabled and self._tenth_of(n) > self._tenth:
            self._tenth = self._tenth_of(n)
            self._line(n)
        self.n = n

    def update(self, k: int = 1) -> None:
        self.update_to(self.n + k)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self._printed != self.n:
            self._line(self.n)

    def _line(self, n: int) -> None:
        rate = (n - self._n0) / max(time.perf_counter() - self._start, 1e-9)
        figures = "".join(f", {k} {v}" for k, v in self.postfix.items())
        print(
            f"{self.desc + ': ' if self.desc else ''}{n}/{self.total} {self.unit} ({100 * n / self.total:.0f} %), "
            f"{rate:.3g} {self.unit}/s{figures}",
            file=self.stream,
            flush=True,
        )
        self._printed = n
