"""The batch plan: a pure function of (sample lengths, seed, epoch, budgets), and its broadcast.

Each epoch is a full random shuffle (no length sorting) packed greedily, in shuffled order, under a
budget of real tokens, a cap on sequences and optionally a cap on anchors. With `lookahead` > 0, when
the next sample does not fit, the first of the next `lookahead` samples that does goes first (`_pack`).
So the batch count changes from epoch to epoch; nothing downstream may assume a constant count.

Packing runs one binary search per batch over prefix sums instead of one Python step per sample: the
next batch ends where the first running total would overflow. With lookahead 0 that is exactly the
sample-by-sample greedy loop (tested), at ~1 microsecond per batch instead of per sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

SKIP_REASONS = ("empty", "no_supervised", "over_budget")


@dataclass(frozen=True)
class BatchPlan:
    epoch: int
    indices: np.ndarray  # int64: sample ids, batch after batch
    offsets: np.ndarray  # int64, len = num_batches + 1: batch b is indices[offsets[b]:offsets[b+1]]
    skipped: dict = field(default_factory=dict)  # reason -> count (same every epoch)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def batch(self, b: int) -> np.ndarray:
        return self.indices[self.offsets[b]:self.offsets[b + 1]]


def anchors_per_sample(lengths: np.ndarray, supervised: np.ndarray, num_anchors: int) -> np.ndarray:
    """Upper bound of anchors a sample contributes (its supervised count, capped per sequence)."""
    return np.minimum(supervised, num_anchors)


def skipped_mask(lengths: np.ndarray, supervised: np.ndarray, token_budget: int) -> dict[str, np.ndarray]:
    """Samples no batch can hold, by reason. Reported, never truncated."""
    empty = lengths <= 0
    return {
        "empty": empty,
        "no_supervised": ~empty & (supervised <= 0),
        "over_budget": ~empty & (supervised > 0) & (lengths > token_budget),
    }


def build_plan(lengths: np.ndarray, supervised: np.ndarray, *, seed: int, epoch: int, token_budget: int,
               max_seqs: int, max_anchors: int = 0, num_anchors: int = 0, lookahead: int = 0) -> BatchPlan:
    lengths = np.asarray(lengths, dtype=np.int64)
    supervised = np.asarray(supervised, dtype=np.int64)
    skip = skipped_mask(lengths, supervised, token_budget)
    keep = ~(skip["empty"] | skip["no_supervised"] | skip["over_budget"])
    if max_anchors > 0:
        anchors = anchors_per_sample(lengths, supervised, num_anchors)
        # A sample alone over the anchor cap would never fit: it is skipped with the over-budget ones.
        over = keep & (anchors > max_anchors)
        skip["over_budget"] = skip["over_budget"] | over
        keep &= ~over

    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    order = order[keep[order]]

    perm, starts = _pack(lengths[order], anchors[order] if max_anchors > 0 else None, token_budget, max_seqs,
                         max_anchors, lookahead)
    return BatchPlan(epoch=epoch, indices=order[perm].astype(np.int64, copy=False),
                     offsets=np.asarray(starts, dtype=np.int64), skipped={k: int(v.sum()) for k, v in skip.items()})


def _pack(lens_arr: np.ndarray, anc_arr: np.ndarray | None, token_budget: int, max_seqs: int, max_anchors: int,
          lookahead: int) -> tuple[np.ndarray, list[int]]:
    """Greedy packing of a shuffled stream. Returns (perm, batch starts): batch b is positions
    perm[starts[b]:starts[b+1]] of the stream.

    Each batch takes the stream's samples while they fit (one bisect over prefix sums). Then the next
    `lookahead` samples are offered in order and each one that still fits joins; the others keep their
    order and start the next batch. Plain next-fit wastes about E[L^2] / (2 E[L]) tokens per batch (6%
    of a 49K budget for a chat mix with a long tail); the window fills most of that gap, and no sample
    moves more than `lookahead` places from the seeded shuffle. Python lists: a few list operations
    per batch.
    """
    from bisect import bisect_right

    n = len(lens_arr)
    # numpy arrays read and written through memoryviews: Python-int access without numpy's per-call cost.
    lens_np, perm_np = np.array(lens_arr, dtype=np.int64), np.arange(n, dtype=np.int64)
    cum_np = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens_np, out=cum_np[1:])
    lens, cum, perm = memoryview(lens_np), memoryview(cum_np), memoryview(perm_np)
    ancs = cum_a = anc_np = None
    if anc_arr is not None:
        anc_np = np.array(anc_arr, dtype=np.int64)
        cum_a_np = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(anc_np, out=cum_a_np[1:])
        ancs, cum_a = memoryview(anc_np), memoryview(cum_a_np)
    starts = [0]
    s = 0
    while s < n:
        hi = min(s + max_seqs, n) + 1
        e = bisect_right(cum, cum[s] + token_budget, s, hi) - 1
        if cum_a is not None:
            e = min(e, bisect_right(cum_a, cum_a[s] + max_anchors, s, hi) - 1)
        # e > s always: every kept sample fits the budget and the anchor cap on its own.
        if lookahead and e < n and e - s < max_seqs:
            # Offer the next `lookahead` samples in order; each one that still fits joins the batch.
            gap = token_budget - (cum[e] - cum[s])
            agap = max_anchors - (cum_a[e] - cum_a[s]) if cum_a is not None else 0
            room, end = max_seqs - (e - s), min(e + lookahead, n)
            taken = []
            for i in range(e, end):
                if lens[i] <= gap and (ancs is None or ancs[i] <= agap):
                    taken.append(i)
                    gap -= lens[i]
                    if ancs is not None:
                        agap -= ancs[i]
                    if len(taken) == room:
                        break
            if taken:
                # Reorder the window as [taken | the others, in their order]; prefix sums change only there.
                new = taken + [i for i in range(e, end) if i not in taken]
                for arr in (lens, perm) if ancs is None else (lens, perm, ancs):
                    vals = [arr[i] for i in new]  # a few items: Python beats a numpy call here
                    for k, v in enumerate(vals, e):
                        arr[k] = v
                for i in range(e, end):
                    cum[i + 1] = cum[i] + lens[i]
                    if cum_a is not None:
                        cum_a[i + 1] = cum_a[i] + ancs[i]
                e += len(taken)
        starts.append(e)
        s = e
    return perm_np, starts


def plan_kwargs(cfg) -> dict:
    """The budgets of `build_plan` taken from a Config."""
    return dict(seed=cfg.train.seed, token_budget=cfg.plan.token_budget, max_seqs=cfg.plan.max_seqs,
                max_anchors=cfg.plan.max_anchors, num_anchors=cfg.objective.num_anchors, lookahead=cfg.plan.lookahead)


def broadcast_plan(plan: BatchPlan | None, *, src: int, group=None) -> BatchPlan:
    """Send rank `src`'s plan to every rank of `group` (a gloo group: plain CPU int64 tensors).

    First a fixed header (epoch, number of batches, number of indices, skip counts), so every receiver
    can size its buffers; then offsets and indices. Every rank returns the same plan.
    """
    rank = dist.get_rank()
    header = torch.zeros(3 + len(SKIP_REASONS), dtype=torch.int64)
    if rank == src:
        assert plan is not None
        header[0], header[1], header[2] = plan.epoch, len(plan), len(plan.indices)
        for i, k in enumerate(SKIP_REASONS):
            header[3 + i] = plan.skipped.get(k, 0)
    dist.broadcast(header, src=src, group=group)
    epoch, nb, ni = (int(x) for x in header[:3])
    if rank == src:
        offsets = torch.from_numpy(plan.offsets)
        indices = torch.from_numpy(plan.indices)
    else:
        offsets = torch.empty(nb + 1, dtype=torch.int64)
        indices = torch.empty(ni, dtype=torch.int64)
    dist.broadcast(offsets, src=src, group=group)
    dist.broadcast(indices, src=src, group=group)
    if rank == src:
        return plan
    skipped = {k: int(header[3 + i]) for i, k in enumerate(SKIP_REASONS)}
    return BatchPlan(epoch=epoch, indices=indices.numpy(), offsets=offsets.numpy(), skipped=skipped)
