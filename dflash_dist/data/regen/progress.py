"""Progress of all ranks, shown by rank 0: conversations and tokens done, the share of replies cut at the
token limit, tokens/s, ETA.

Ranks share no process group (each runs its own engine), so each writes its running totals to a small
file in the parts directory (atomically, at most every `every_s`); rank 0 sums them. On a terminal the
line is a tqdm bar; in a log file it is a plain line every `every_s`. A progress file that cannot be
written (a full disk) costs a warning, never the run: the chunks are what must be whole.

Tokens are counted per finished reply (each turn), conversations when their last turn ends. The rates,
and the ETA from them, are shown only after MIN_RATE_S of generation: the engines' start-up (vLLM's takes
minutes on CPU) is left out, and the first few replies say little about the rest (an early ETA read
2:26:30 for a run that ended 4 minutes later).
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

from dflash_dist.io.files import write_json

log = logging.getLogger(__name__)

MIN_RATE_S = 30.0  # seconds of generation before a rate (and an ETA) is shown


class RankProgress:
    """This rank's totals: conversations finished in the chunk in hand (finished chunks are counted from
    their own files), tokens generated since it started."""

    def __init__(self, parts: Path, rank: int, every_s: float = 2.0):
        self.path, self.every_s = parts / f"progress-rank{rank}.json", every_s
        self.partial = self.tokens = self.replies = self.cut = 0
        self._last = 0.0
        self._warned = False
        self.add(flush=True)  # replaces what an earlier run left

    def add(self, conversations: int = 0, tokens: int = 0, replies: int = 0, cut: int = 0,
            flush: bool = False) -> None:
        """`replies` generated, `cut` of them at the token limit (this run's, whatever became of them)."""
        self.partial += conversations
        self.tokens += tokens
        self.replies += replies
        self.cut += cut
        now = time.monotonic()
        if flush or now - self._last >= self.every_s:
            self._last = now
            self._write()

    def _write(self) -> None:
        try:
            write_json(self.path, {"partial": self.partial, "tokens": self.tokens, "replies": self.replies,
                                   "cut": self.cut, "t": time.time()})
        except OSError as exc:  # write_json left no temporary file behind
            if not self._warned:
                self._warned = True
                log.warning("cannot write %s (%s): the progress line misses this rank's latest totals; the run "
                            "goes on", self.path, exc.strerror or exc)

    def chunk_written(self) -> None:
        self.partial = 0
        self.add(flush=True)


def eta_text(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def cut_text(replies: int, cut: int) -> str:
    return f"  {cut}/{replies} replies cut at the token limit ({100.0 * cut / replies:.1f}%)" if replies else ""


def status_line(done: int, total: int, tokens: int, tok_s: float, conv_s: float, measured_s: float = float("inf"),
                replies: int = 0, cut: int = 0) -> str:
    """done/total conversations (an earlier run's included), this run's tokens and cut replies; the rates and
    ETA once `measured_s` of generation (MIN_RATE_S) stand behind them."""
    pct = 100.0 * done / total if total else 100.0
    head = f"regenerate: {done}/{total} conversations ({pct:.1f}%)  {tokens} tokens{cut_text(replies, cut)}"
    if measured_s < MIN_RATE_S:
        return f"{head}  (rates and ETA after {MIN_RATE_S:.0f} s of generation)"
    eta = (total - done) / conv_s if conv_s > 0 else float("inf")
    return f"{head}  {tok_s:.1f} tok/s  ETA {eta_text(eta)}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # replaced or removed while we read it: counted next time
        return {}


class Reporter:
    """Rank 0's thread: reads every rank's totals and reports them until stopped."""

    def __init__(self, parts: Path, total: int, done_before: int, every_s: float = 30.0):
        self.parts, self.total, self.done_before, self.every_s = parts, total, done_before, every_s
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.chunk_lines: dict[str, int] = {}  # finished chunk -> its input lines (read once)
        self.first: tuple[float, int, int] | None = None  # (time, conversations, tokens) when tokens first came
        self._stop = threading.Event()
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm  # installed with transformers and vllm
                self._bar = tqdm(total=total, initial=done_before, unit="conv", desc="regenerate", smoothing=0.1)
            except ImportError:  # plain lines then
                pass
        self._thread = threading.Thread(target=self._run, name="regen-progress", daemon=True)

    def totals(self) -> tuple[int, int]:
        """(conversations done, tokens generated by this run) over all ranks."""
        conv, tok, _, _ = self.all_totals()
        return conv, tok

    def all_totals(self) -> tuple[int, int, int, int]:
        """(conversations done, and this run's tokens, replies and cut replies) over all ranks."""
        for p in self.parts.glob("chunk-*.json"):
            if p.name not in self.chunk_lines:
                self.chunk_lines[p.name] = _read(p).get("lines", 0)
        conv, tok, replies, cut = sum(self.chunk_lines.values()), 0, 0, 0
        for p in self.parts.glob("progress-rank*.json"):
            d = _read(p)
            if d.get("t", 0) >= self.wall0 - 10:  # a rank not started yet may still show an earlier run's
                conv, tok = conv + d["partial"], tok + d["tokens"]
                replies, cut = replies + d.get("replies", 0), cut + d.get("cut", 0)
        return conv, tok, replies, cut

    def rates(self, now: float, done: int, tokens: int) -> tuple[float, float]:
        """(tokens/s, conversations/s) since the first tokens came (the engines' start-up, a minute or
        more, would otherwise stretch the ETA), or since the start when that is under a second ago."""
        if self.first is None and tokens > 0:
            self.first = (now, done, tokens)
        t, d, k = self.first if self.first and now - self.first[0] >= 1.0 else (self.t0, self.done_before, 0)
        dt = max(now - t, 1e-9)
        return (tokens - k) / dt, (done - d) / dt

    def report(self) -> str:
        done, tokens, replies, cut = self.all_totals()
        now = time.monotonic()
        tok_s, conv_s = self.rates(now, done, tokens)
        measured = now - self.first[0] if self.first else 0.0
        if self._bar is not None:
            self._bar.n = done
            rate = f", {tok_s:.0f} tok/s" if measured >= MIN_RATE_S else ""
            self._bar.set_postfix_str(f"{tokens} tok{rate}, cut {cut}/{replies}", refresh=True)
        line = status_line(done, self.total, tokens, tok_s, conv_s, measured, replies, cut)
        if self._bar is None:
            log.info("%s", line)
        return line

    def _run(self) -> None:
        while not self._stop.wait(1.0 if self._bar is not None else self.every_s):
            self.report()

    def start(self) -> "Reporter":
        self._thread.start()
        return self

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(timeout=5)
        line = self.report()
        if self._bar is not None:
            self._bar.close()
        return line
