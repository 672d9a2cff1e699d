"""One epoch's schedule, shared by both roles: which batch each drafter trains at each global step, and
where the stop votes fall. Pure arithmetic over (batches in the plan, where this run starts, drafters).

`origin` is the first batch of the epoch this run trains (0, or a resumed cursor's batch). Batches before
it were trained by an earlier run, possibly on another layout, so steps and routes count from it: step s
trains batches origin + s*D ... origin + s*D + D - 1, batch b goes to drafter (b - origin) mod D and to
the target that `Layout.route` gives its relative index b - origin.

Tail rule: when the batches left are not a multiple of D, the last step has k < D real batches. The D - k
drafters without one contribute zero gradients (they take part in the all-reduce but compute nothing),
and the sum is divided by k, so the gradient is the mean over the k real batches. Nothing is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_dist.parallel.topology import Layout


@dataclass(frozen=True)
class Cursor:
    """A run's position in the plan: what a checkpoint records and a resumed run starts from."""
    epoch: int  # the epoch to continue
    batch: int  # global index, in that epoch's plan, of the first batch not yet trained (0 = epoch start)


@dataclass(frozen=True)
class EpochSchedule:
    epoch: int
    num_batches: int  # the count broadcast with this epoch's plan
    origin: int  # first batch trained by this run (0 at an epoch start)
    num_drafters: int
    sync_every: int  # global steps between stop votes

    @property
    def steps(self) -> int:
        return -(-(self.num_batches - self.origin) // self.num_drafters)

    def batch(self, step: int, j: int) -> int | None:
        """Drafter j's batch at `step`, or None in a tail step without one for it."""
        b = self.origin + step * self.num_drafters + j
        return b if b < self.num_batches else None

    def real(self, step: int) -> int:
        """Batches trained at `step` (D, or fewer in the tail step)."""
        return min(self.num_drafters, self.num_batches - self.origin - step * self.num_drafters)

    def idle(self) -> int:
        """Drafters without a batch in the last step."""
        return self.steps * self.num_drafters - (self.num_batches - self.origin)

    def step_of(self, b: int) -> int:
        return (b - self.origin) // self.num_drafters

    def next_batch(self, step: int) -> int:
        """The cursor's batch once steps [0, step) are trained."""
        return min(self.num_batches, self.origin + step * self.num_drafters)

    def route(self, layout: Layout, b: int) -> tuple[int, int]:
        """(target rank, drafter rank) of batch b: the layout's round-robin counted from `origin`."""
        return layout.route(b - self.origin)

    def target_batches(self, layout: Layout, rank: int) -> list[int]:
        """The batches a target rank computes, in increasing order."""
        return [b + self.origin for b in layout.batches_of(rank, self.num_batches - self.origin)]


class Votes:
    """The stop votes of one epoch at the schedule's boundaries, passed in order by every rank (targets
    before each batch they compute, drafters before each step); see stop.py for the agreement itself."""

    def __init__(self, sched: EpochSchedule, agreement) -> None:
        self.sched, self.agreement, self.k = sched, agreement, 1

    def reach(self, step: int) -> bool:
        """Pass every boundary at or before `step`. True: every rank stops at `stop_step()`."""
        S = self.sched.sync_every
        while self.k * S <= step and self.k * S < self.sched.steps:
            stop = self.agreement.boundary(self.k)
            self.k += 1
            if stop:
                return True
        return False

    def stop_step(self) -> int:
        """The step at which the last boundary passed lies."""
        return (self.k - 1) * self.sched.sync_every

    def stops_by(self, step: int) -> bool:
        """For prefetching: is a stop decided at the boundary of `step`'s window (so `step` never runs)?"""
        k = step // self.sched.sync_every
        return k >= 1 and self.agreement.decided(k)

    def finish(self) -> bool:
        """The epoch-end vote: True = stop before the next epoch."""
        return self.agreement.finish()
