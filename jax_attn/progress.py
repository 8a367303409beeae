"""Progress of a warm-up: one line per finished item (item i of n, elapsed time), a bar while a
terminal is attached, and the total at the end.

    with Progress(len(buckets), "capture") as progress:
        for bs in buckets:
            ...
            progress.step(f"DECODE bs={bs}", f"compile {dt:.1f}s")
    # capture 1/3 DECODE bs=64: compile 2.1s [2.3s]
    # ...
    # capture: 3 of 3 in 6.9s (compile 5.8s)

``step`` may be called from worker threads (buckets compiled in parallel finish in any order).
Used by ``StepRunner.capture``; the torch bridge's graph capture can report through it too.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, TextIO

BAR_WIDTH = 24


class Progress:
    """Reports ``total`` items of one warm-up on ``stream`` (default ``sys.stderr``).

    Args:
      total: items expected; None when not known in advance (no "of n", no bar).
      what: the warm-up's name, the first word of every line.
      stream: where lines go; a bar is redrawn below them only when ``stream.isatty()``
        (``bar`` forces it on or off).
      enabled: False reports nothing (the counts and times are still kept).
      clock: seconds since an arbitrary origin (tests pass a fake one).
    """

    def __init__(self, total: Optional[int], what: str = "warm-up", *, stream: Optional[TextIO] = None,
                 enabled: bool = True, bar: Optional[bool] = None, clock: Callable[[], float] = time.perf_counter):
        self.total, self.what, self.enabled, self._clock = total, what, enabled, clock
        self.stream = sys.stderr if stream is None else stream
        self.bar = bool(total) and (_isatty(self.stream) if bar is None else bar)
        self.done = 0
        self.start = clock()
        self._lock = threading.Lock()
        self._bar_shown = False
        if enabled and self.bar:
            self._draw_bar()
            self.stream.flush()

    def elapsed(self) -> float:
        return self._clock() - self.start

    def step(self, label: str, detail: str = "") -> None:
        """One item finished: ``"{what} {i}/{n} {label}: {detail} [{elapsed}s]"``."""
        with self._lock:
            self.done += 1
            if not self.enabled:
                return
            count = self.done if self.total is None else f"{self.done}/{self.total}"
            line = f"{self.what} {count} {label}" + (f": {detail}" if detail else "")
            self._write(f"{line} [{self.elapsed():.1f}s]")

    def finish(self, detail: str = "") -> float:
        """The summary line ``"{what}: {done} of {n} in {elapsed}s ({detail})"``; returns the elapsed seconds."""
        with self._lock:
            elapsed = self.elapsed()
            if self.enabled:
                done = self.done if self.total is None else f"{self.done} of {self.total}"
                self._write(f"{self.what}: {done} in {elapsed:.1f}s" +
                            (f" ({detail})" if detail else ""), redraw=False)
            return elapsed

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar_shown:  # an exception left the bar drawn: end its line
            with self._lock:
                self._clear_bar()

    # ---- output (lock held) -------------------------------------------------------------------
    def _write(self, line: str, redraw: bool = True) -> None:
        self._clear_bar()
        self.stream.write(line + "\n")
        if self.bar and redraw and self.done < self.total:  # (no bar without a total)
            self._draw_bar()
        self.stream.flush()

    def _draw_bar(self) -> None:
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        self.stream.write(f"{self.what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                          f"{self.done}/{self.total} {self.elapsed():.1f}s")
        self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.stream.write("\r\x1b[2K")  # back to the line start, erase it
            self._bar_shown = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
