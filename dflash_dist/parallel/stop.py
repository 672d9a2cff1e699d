"""Preemption: a signal sets a local flag; the ranks agree on a stop point at a step boundary.

A rank blocked inside a recv cannot run a Python signal handler, so the handler only sets a flag and
the agreement happens in band, on the gloo control group, at fixed points every rank reaches in the
same order: the start of the epoch (or of the resumed part of it) and every `sync_every` global steps.

At boundary k each rank waits for the all-reduce(MAX) it issued two boundaries earlier (its result is
the decision for boundary k), then issues the next one. The wait costs nothing in steady state: a
target reaches boundary k long after every drafter issued the vote of k-2 (see StopAgreement.LAG). A
drafter that prefetches into window k needs decision k early: it resolves it as soon as it first posts
a recv past the boundary, which is after it issued that vote itself. So a signal stops the run within
about three windows, at a step boundary that every rank agrees on.
"""
from __future__ import annotations

import logging
import signal
import time
from collections import deque

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# SIGINT (Ctrl-C, which torchrun forwards to its workers) asks for the same clean stop as a scheduler's
# SIGTERM; a second SIGINT on the same rank aborts at once, without saving.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


class StopFlag:
    """Set by a stop signal on this rank. `requested` may also be read as "this rank asked"; whether
    the run stops is decided by StopAgreement, so the rank that got the signal may be any rank."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""  # the first stop signal received here ("" if none)
        self.requested_at = 0.0  # time.time() when it arrived here
        self.interrupts = 0  # SIGINTs received here

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                # Restore the default first, so a third Ctrl-C is never swallowed by this handler.
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt("second SIGINT: aborting at once, without saving")
        if not self.requested:
            self.requested = True
            self.requested_at = time.time()
            self.signal_name = name
            log.warning("received %s: stopping at the next agreed step boundary and saving%s", name,
                        " (Ctrl-C again to abort without saving)" if signum == signal.SIGINT else "")
        else:
            log.warning("received %s: a stop is already requested (%s)", name, self.describe())

    def describe(self, now: float | None = None) -> str:
        """What made this rank stop, for its log line: e.g. "SIGTERM received here 3.1 s ago", or
        "stop requested by another rank" when the agreement carried another rank's signal."""
        if not self.signal_name:
            return "stop requested by another rank"
        now = time.time() if now is None else now
        return f"{self.signal_name} received here {now - self.requested_at:.1f} s ago"


class StopAgreement:
    """One per epoch (or resumed part of one). `boundary(k)` must be called for k = 1, 2, ... in
    order by every rank; `decided(k)` may be called earlier to learn decision k (it waits for it).

    Decision k is the vote issued LAG boundaries earlier. With LAG = 1 a target arriving at boundary k
    would wait for the drafters to reach boundary k-1, i.e. to come within one window of it; when the
    targets are the bottleneck that is a stall of about one drafter step per window (measured: targets
    waited 12-18% with sync_every=2). With LAG = 2 the drafters only need to be within 2 windows, which
    they are, since they lag the targets by at most max_in_flight (<= sync_every) steps plus one.
    """
    LAG = 2

    def __init__(self, flag: StopFlag, group) -> None:
        self.flag, self.group = flag, group
        self.pending: deque = deque()  # (work, tensor, k of the decision it carries), oldest first
        self.decisions: dict[int, bool] = {}
        for k in range(1, self.LAG + 1):
            self._issue(k)

    def _issue(self, k: int) -> None:
        t = torch.tensor([int(self.flag.requested)], dtype=torch.int64)
        self.pending.append((dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t, k))

    def decided(self, k: int) -> bool:
        """Decision for boundary k: stop there? Waits for the vote that carries it."""
        if k not in self.decisions:
            work, t, pk = self.pending.popleft()
            assert pk == k, f"stop decision {k} asked out of order (next vote carries {pk})"
            work.wait()
            self.decisions[k] = bool(t.item())
        return self.decisions[k]

    def boundary(self, k: int) -> bool:
        """At boundary k: True = stop here (every rank gets the same answer)."""
        if self.decided(k):
            return True
        self._issue(k + self.LAG)
        return False

    def finish(self) -> bool:
        """At the end of the epoch: resolve what is pending, then one blocking vote. True = stop."""
        pending = False
        while self.pending:
            work, t, _ = self.pending.popleft()
            work.wait()
            pending |= bool(t.item())
        t = torch.tensor([int(self.flag.requested or pending)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())
