"""Progress of the long command-line jobs (data preparation, benchmarks): a tqdm bar when stderr is a
terminal; plain log lines, at most one every `every_s` seconds, when it is not (a log file, a Slurm output),
so that a log holds readable lines instead of a bar's carriage returns. Without tqdm: log lines everywhere.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:  # an optional extra (report, dev): the log lines do without it
        return None
    return tqdm


def _scaled(x: float, unit_scale: bool) -> str:
    if not unit_scale:
        return f"{x:,.0f}" if x >= 10 or x == int(x) else f"{x:.2f}"
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{prefix}"
    return f"{x:.0f}"


class Bar:
    """`with Bar(total, "prepare chats.jsonl", "B", unit_scale=True) as bar: bar.update(n, kept=k)`."""

    def __init__(self, total: float | None, desc: str, unit: str = "it", *, every_s: float = 10.0,
                 unit_scale: bool = False, leave: bool = True, stream=None, logger: logging.Logger | None = None):
        stream = stream or sys.stderr
        tqdm = _tqdm() if getattr(stream, "isatty", lambda: False)() else None
        self.total, self.desc, self.unit, self.every_s, self.unit_scale = total, desc, unit, every_s, unit_scale
        self.done, self.postfix, self.log, self.stream = 0.0, {}, logger or log, stream
        self.t0 = self.last = time.monotonic()
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, leave=leave, file=stream,
                        dynamic_ncols=True) if tqdm else None

    def update(self, n: float = 1, **postfix) -> None:
        self.done += n
        self.postfix.update(postfix)
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            if self.log.hasHandlers():
                self.log.info("%s", self.line(now))
            else:  # a command that set up no logging (the benchmarks print tables): the line goes to stderr
                self.stream.write(self.line(now) + "\n")
                self.stream.flush()

    def line(self, now: float | None = None) -> str:
        """The log line: done of total, rate, time left, and the caller's counters."""
        elapsed = max((now or time.monotonic()) - self.t0, 1e-9)
        rate = self.done / elapsed
        s = self._scale
        text = f"{self.desc}: {s(self.done)}"
        if self.total:
            text = f"{self.desc}: {100 * self.done / self.total:5.1f}% ({s(self.done)} of {s(self.total)} {self.unit})"
            if rate > 0:
                left = int((self.total - self.done) / rate)
                text += f", {left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d} left"
        else:
            text += f" {self.unit}"
        text += f", {s(rate)} {self.unit}/s"
        return text + "".join(f", {k} {v}" for k, v in self.postfix.items())

    def _scale(self, x: float) -> str:
        return _scaled(x, self.unit_scale)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def track(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None, **kw) -> Iterator[T]:
    """`for x in track(items, "what"):` with a `Bar` over them (`kw`: Bar's options)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Bar(total, desc, unit, **kw) as bar:
        for x in items:
            yield x
            bar.update()
