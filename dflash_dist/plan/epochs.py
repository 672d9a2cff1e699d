"""The batch plan: a pure function of (sample lengths, seed, epoch, budgets), and its broadcast.

Each epoch is a full random shuffle (no length sorting) packed greedily under a budget of real tokens,
a cap on sequences and optionally a cap on anchors. So the batch count changes from epoch to epoch;
nothing downstream may assume a constant count. Three packing rules (`plan.packing`):

- `next_fit`: the shuffled stream is cut into batches in order; a batch closes when its next sample
  does not fit. It leaves about E[L^2] / (2 E[L]) tokens empty per batch.
- `fill` (default): the same, but the gaps next-fit leaves are filled with short samples. The shuffled
  stream is split by size into long and short samples, each keeping its shuffled order; the long ones
  are packed by next-fit; the short ones, laid end to end along those batches' gaps laid end to end,
  join the batch whose gap holds them whole (room and anchors permitting); the short ones left over
  are packed by next-fit; then the batch order is shuffled, so that short-only batches do not gather
  at the epoch's end. The split (`_short_max`) gives the short side about the tokens the gaps need:
  with more, short-only batches hit the sequence cap before the budget; with fewer, late gaps stay
  empty. Fill and build times at 902K samples: docs/benchmarks.md (plan).
- `sorted`: the rule this project replaced, kept for comparison and diagnosis. The kept samples are
  sorted by length once and packed by next-fit into fixed batches; only the batches' order is shuffled
  each epoch. The batch count is then the same every epoch, but every batch holds samples of one length
  (batch 0 always the shortest), so the loss and accuracy swing with the length of the batch a step
  draws (docs/operations.md, "Reading a run").

Both are vectorised: prefix sums and one `searchsorted` give the end of the batch that would start at
every position, and only the walk from batch start to batch start is a Python loop (one list step per
batch).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from dflash_dist.config import ConfigError, choices
from dflash_dist.data.anchors import anchors_per_sample  # the rule's, imported here by the plan's users too
from dflash_dist.plan.seeding import seeded_generator

SKIP_REASONS = ("empty", "no_supervised", "no_anchor", "over_budget")  # in order of precedence
PACKINGS = choices()["plan.packing"]

log = logging.getLogger(__name__)


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


def skipped_mask(lengths: np.ndarray, supervised: np.ndarray, token_budget: int,
                 anchorable: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Samples no batch can hold or train, by reason (the first that applies, in SKIP_REASONS order).
    Reported, never cut here: under plan.long_samples=truncate the plan is given the dataset already cut
    (plan/long_samples.py), so no sample is over the budget by length. Without `anchorable` no sample is
    found anchorless."""
    empty = lengths <= 0
    no_supervised = ~empty & (supervised <= 0)
    no_anchor = ~empty & ~no_supervised & (anchorable <= 0) if anchorable is not None else np.zeros_like(empty)
    return {
        "empty": empty,
        "no_supervised": no_supervised,
        "no_anchor": no_anchor,
        "over_budget": ~(empty | no_supervised | no_anchor) & (lengths > token_budget),
    }


def plan_skips(lengths: np.ndarray, supervised: np.ndarray, token_budget: int, anchorable: np.ndarray | None = None,
               max_anchors: int = 0, num_anchors: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(the samples every plan skips, by reason; anchors per sample when `max_anchors` caps them): `skipped_mask`
    plus, under an anchor cap, the samples whose anchors alone exceed it (they would never fit a batch:
    skipped with the over-budget ones). The same every epoch; the start-of-run checks weigh them too."""
    skip = skipped_mask(lengths, supervised, token_budget, anchorable)
    anchors = None
    if max_anchors > 0:
        # Without anchor positions, the supervised count bounds the anchors from above.
        anchors = anchors_per_sample(supervised if anchorable is None else anchorable, num_anchors)
        over = ~np.logical_or.reduce(list(skip.values())) & (anchors > max_anchors)
        skip["over_budget"] = skip["over_budget"] | over
    return skip, anchors


def build_plan(lengths: np.ndarray, supervised: np.ndarray, *, seed: int, epoch: int, token_budget: int,
               max_seqs: int, max_anchors: int = 0, num_anchors: int = 0, packing: str = "fill",
               anchorable: np.ndarray | None = None) -> BatchPlan:
    """The epoch's batches. `anchorable` (anchor positions per sample, `TokenDataset.num_anchorable`)
    skips samples without one, so every batch has an anchor; runs always pass it (`plan_for_epoch`)."""
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    supervised = np.asarray(supervised, dtype=np.int64)
    if anchorable is not None:
        anchorable = np.asarray(anchorable, dtype=np.int64)
    skip, anchors = plan_skips(lengths, supervised, token_budget, anchorable, max_anchors, num_anchors)
    keep = ~np.logical_or.reduce(list(skip.values()))

    gen = epoch_generator(seed, epoch)
    order = shuffled(np.flatnonzero(keep), gen)
    lens, anc = lengths[order], anchors[order] if anchors is not None else None
    caps = (token_budget, max_seqs, max_anchors)
    if packing == "next_fit":
        indices, offsets = order, _next_fit(lens, anc, *caps)
    elif packing == "sorted":
        indices, offsets = _sorted(np.flatnonzero(keep), lengths, anchors, *caps, gen)
    else:
        indices, offsets = _fill(order, lens, anc, *caps, gen)
    return BatchPlan(epoch=epoch, indices=indices, offsets=offsets, skipped={k: int(v.sum()) for k, v in skip.items()})


def plan_for_epoch(ds, cfg, epoch: int) -> BatchPlan:
    """The epoch's plan of a dataset under a Config: the one place that calls `build_plan` for a run,
    with each sample's anchor positions."""
    return build_plan(ds.lengths, ds.num_supervised, anchorable=ds.num_anchorable,
                      epoch=epoch, **plan_kwargs(cfg))


# Why a sample is skipped, and what to change when every sample is.
_SKIP_FIX = {
    "empty": "no tokens: check data.path, or data.synthetic.*",
    "no_supervised": "no supervised token: check the loss mask of data.path (assistant turns?)",
    "no_anchor": "no supervised token after the first: check the loss mask of data.path",
    "over_budget": "longer than a batch may hold: raise plan.token_budget (or plan.max_anchors)",
}


def check_trainable(epoch_counts: list[int], skipped: dict, num_samples: int) -> None:
    """ConfigError (exit 2, before any rank waits on another) when an epoch's plan has no batch,
    naming the skipped counts by reason and the key to change."""
    empty = [e for e, n in enumerate(epoch_counts) if n == 0]
    if not empty:
        return
    where = f"nothing to train: epoch {empty[0] + 1} of {len(epoch_counts)} has no batch"
    if num_samples == 0:
        raise ConfigError(f"{where}: the dataset has no samples (check data.path, or data.synthetic.num_samples)")
    reasons = "; ".join(f"{k} {n} ({_SKIP_FIX[k]})" for k in SKIP_REASONS if (n := skipped.get(k, 0)) > 0)
    raise ConfigError(f"{where}: the plan skips {sum(skipped.values())} of {num_samples} samples: "
                      f"{reasons or 'none by reason (check plan.max_seqs)'}")


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The epoch's random stream: (seed, epoch) hashed to one 64-bit seed, so no two share a stream."""
    return seeded_generator(seed, epoch)


def permutation(n: int, gen: torch.Generator) -> np.ndarray:
    """A uniform random permutation of range(n). torch's CPU randperm in int32 takes 6-20 ms for 902K
    samples where numpy's int64 permutation takes 60 ms (a quarter of the plan's time budget)."""
    return torch.randperm(n, generator=gen, dtype=torch.int32 if n < 2**31 else torch.int64).numpy()


def shuffled(values: np.ndarray, gen: torch.Generator) -> np.ndarray:
    """`values[permutation(len(values), gen)]`, gathered by torch: 4 ms for 902K int64 where numpy's
    fancy indexing takes 15 ms (it converts the int32 indices first)."""
    perm = torch.from_numpy(permutation(len(values), gen))
    return torch.index_select(torch.from_numpy(values), 0, perm).numpy()


def _next_fit(lens: np.ndarray, anc: np.ndarray | None, token_budget: int, max_seqs: int,
              max_anchors: int) -> np.ndarray:
    """Batch starts, and the end, of next-fit over `lens` in order (batch b is [starts[b], starts[b+1]))."""
    n = len(lens)
    cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=cum[1:])
    end = np.searchsorted(cum, cum[:-1] + token_budget, side="right") - 1
    if anc is not None:
        cum_a = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(anc, out=cum_a[1:])
        np.minimum(end, np.searchsorted(cum_a, cum_a[:-1] + max_anchors, side="right") - 1, out=end)
    np.minimum(end, np.arange(max_seqs, n + max_seqs), out=end)
    # end[s] > s: every kept sample fits the budget and the anchor cap on its own. A memoryview reads
    # Python ints without numpy's per-item cost; the walk is ~50K steps for a 902K-sample epoch.
    hop, starts, s = memoryview(end), [0], 0
    while s < n:
        s = hop[s]
        starts.append(s)
    return np.asarray(starts, dtype=np.int64)


def _fill(ids: np.ndarray, lens: np.ndarray, anc: np.ndarray | None, token_budget: int, max_seqs: int,
          max_anchors: int, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The `fill` rule (module docstring) over the stream `ids`. Returns (indices, offsets): each batch
    holds its long samples, then the short ones that joined, in stream order."""
    n = len(lens)
    # Split and lay along the budget that binds: tokens, or anchors when the mean sample takes a larger
    # share of the anchor cap than of the token budget (then tokens are the cap checked on the side).
    caps = [(lens, token_budget)] + ([(anc, max_anchors)] if anc is not None else [])
    if n and anc is not None and anc.mean() / max_anchors > lens.mean() / token_budget:
        caps.reverse()
    (size, budget), side = caps[0], caps[1:]
    short = size <= _short_max(size, budget) if n else np.zeros(0, dtype=bool)
    long_pos, short_pos = np.flatnonzero(~short), np.flatnonzero(short)
    starts = _next_fit(lens[long_pos], anc[long_pos] if anc is not None else None, token_budget, max_seqs,
                       max_anchors)
    nb, count = len(starts) - 1, np.diff(starts)

    # Short samples laid end to end along the gaps laid end to end: sample j covers [end_j - size_j, end_j)
    # and joins gap b when that interval lies inside [gap_end[b-1], gap_end[b]). Its gap b (the first with
    # gap_end[b] >= end_j) is counted from the other side, one search per gap instead of one per sample.
    gap_end = np.cumsum(budget - _batch_sums(size[long_pos], starts))
    s_size = size[short_pos]
    s_end = np.cumsum(s_size)
    b = np.cumsum(np.bincount(np.searchsorted(s_end, gap_end, side="right"), minlength=len(s_end) + 1))[:-1]
    m = int(np.searchsorted(b, nb))  # b never decreases: the samples past the last gap are a suffix
    sel = np.flatnonzero(s_end[:m] - s_size[:m] >= np.concatenate(([0], gap_end))[b[:m]])
    b = b[sel]
    # Within each gap, the short samples that joined are a run; the cap on sequences and the side cap keep
    # a prefix of it (a gap that refuses one sample takes no later one), so the kept ones stay contiguous.
    i = np.arange(len(sel))
    first = np.ones(len(sel), dtype=bool)
    first[1:] = b[1:] != b[:-1]
    rank = i - np.maximum.accumulate(np.where(first, i, 0))
    ok = rank < max_seqs - count[b]
    for other, cap in side:
        cum = np.cumsum(other[short_pos[sel]])
        before = np.maximum.accumulate(np.where(first, cum - other[short_pos[sel]], 0))
        ok &= cum - before <= cap - _batch_sums(other[long_pos], starts)[b]
    sel, b, rank = sel[ok], b[ok], rank[ok]
    rest = np.delete(short_pos, sel)
    if nb:
        # The last long batch is usually far from full (the stream ran out): it is reopened as the first
        # batch of the left-over short ones rather than closed with a second part-full batch beside it.
        nb, last = nb - 1, b == nb - 1
        rest = np.concatenate([long_pos[starts[nb]:], short_pos[sel[last]], rest])
        sel, b, rank, starts, count = sel[~last], b[~last], rank[~last], starts[:-1], count[:-1]
        long_pos = long_pos[:starts[-1]]
    rstarts = _next_fit(lens[rest], anc[rest] if anc is not None else None, token_budget, max_seqs, max_anchors)
    nr = len(rstarts) - 1

    # Batch k of [long batches, short-only batches] goes to place slot[k]; every sample is written
    # straight to its position (no sort): a batch's members are contiguous, so the writes are too.
    rcount = np.diff(rstarts)
    members = np.concatenate([count + np.bincount(b, minlength=nb), rcount])
    slot = permutation(nb + nr, gen)
    offsets = np.zeros(nb + nr + 1, dtype=np.int64)
    offsets[1:][slot] = members
    np.cumsum(offsets, out=offsets)
    at = offsets[slot]  # first position of batch k
    indices = np.empty(n, dtype=np.int64)
    indices[np.repeat(at[:nb] - starts[:-1], count) + np.arange(len(long_pos))] = ids[long_pos]
    indices[(at[:nb] + count)[b] + rank] = ids[short_pos[sel]]
    indices[np.repeat(at[nb:] - rstarts[:-1], rcount) + np.arange(len(rest))] = ids[rest]
    return indices, offsets


def _sorted(ids: np.ndarray, lengths: np.ndarray, anchors: np.ndarray | None, token_budget: int, max_seqs: int,
            max_anchors: int, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The `sorted` rule: `ids` by length (ties by id, so the same batches every epoch) cut by next-fit;
    then the batches, whole, in an order drawn from `gen`."""
    ids = ids[np.argsort(lengths[ids], kind="stable")]
    starts = _next_fit(lengths[ids], anchors[ids] if anchors is not None else None, token_budget, max_seqs,
                       max_anchors)
    sizes = np.diff(starts)
    perm = permutation(len(sizes), gen)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes[perm], out=offsets[1:])
    # Position i of the new order holds the sample at starts[perm[k]] + (i - offsets[k]), k its batch.
    src = np.repeat(starts[:-1][perm] - offsets[:-1], sizes[perm]) + np.arange(len(ids))
    return ids[src], offsets


def _short_max(size: np.ndarray, budget: int, sample: int = 16384) -> float:
    """The split between long and short samples: the smallest size at which the short ones carry as many
    tokens as the gaps next-fit will leave among the long ones.

    Too few short samples leave late gaps unfilled; too many leave short-only batches that the cap on
    sequences can stop short of the budget (giving them 0.6x-2x the gaps' tokens instead of 1x was worse
    on every mix measured, docs/benchmarks.md). Next-fit leaves about E[L^2] / (2 E[L]) empty per batch
    (the sample that overflows is length-biased). Estimated on the stream's first `sample` samples: the
    stream is shuffled, so they are a uniform sample, and sorting them costs ~1 ms.
    """
    s = np.sort(size[:sample]).astype(np.float64)
    short_mass = np.cumsum(s)  # threshold s[k]: s[:k+1] are short, s[k+1:] long
    long_mass = short_mass[-1] - short_mass
    long_sq = np.cumsum((s * s)[::-1])[::-1]
    long_sq = np.append(long_sq[1:], 0.0)
    waste = np.divide(long_sq, 2 * long_mass, out=np.zeros_like(s), where=long_mass > 0)
    gap_mass = long_mass / (budget - waste) * waste  # waste <= max(L) / 2 <= budget / 2
    return s[int(np.argmax(short_mass >= gap_mass))]


def _batch_sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    cum = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=cum[1:])
    return cum[starts[1:]] - cum[starts[:-1]]


def plan_kwargs(cfg) -> dict:
    """The budgets of `build_plan` taken from a Config."""
    return dict(seed=cfg.train.seed, token_budget=cfg.plan.token_budget, max_seqs=cfg.plan.max_seqs,
                max_anchors=cfg.plan.max_anchors, num_anchors=cfg.objective.num_anchors, packing=cfg.plan.packing)


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


# -- the plan's life in a run: counted at start, rebuilt and verified each epoch, broadcast --------------

def plan_digest(plan: BatchPlan) -> str:
    """Short fingerprint of a plan, logged by every rank so a disagreement is visible."""
    h = hashlib.sha1(plan.offsets.tobytes())
    h.update(plan.indices.tobytes())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class PlanCount:
    """What rank 0 learns by building every epoch's plan at start."""
    counts: list[int]  # batches per epoch: the LR horizon and the ETA use their exact sum
    skipped: dict  # samples every plan skips, by reason (the same each epoch)
    digests: list[str]  # fingerprints, kept with each checkpoint (a mid-epoch resume must rebuild the same)
    plans: list[BatchPlan]  # the plans themselves, for the rest of start-up (the memory pre-flight)


def plan_shape(plan: BatchPlan, lengths) -> dict:
    """Samples and real tokens per batch of a plan (mean, min, max), as the run report draws them per epoch."""
    seqs = np.diff(plan.offsets)
    if not len(seqs):
        return {}
    cum = np.concatenate([[0], np.cumsum(np.asarray(lengths)[plan.indices])])
    toks = cum[plan.offsets[1:]] - cum[plan.offsets[:-1]]
    return {"samples_mean": float(seqs.mean()), "samples_min": int(seqs.min()), "samples_max": int(seqs.max()),
            "tokens_mean": float(toks.mean()), "tokens_min": int(toks.min()), "tokens_max": int(toks.max())}


def count_epochs(ds, cfg) -> PlanCount:
    """Rank 0: build every epoch's plan once, log its shape, keep its count and fingerprint."""
    plans = [plan_for_epoch(ds, cfg, e) for e in range(cfg.train.epochs)]
    for p in plans:
        if len(p):
            sh = plan_shape(p, ds.lengths)
            log.info("epoch %d plan: %d batches; samples per batch mean %.1f min %d max %d; real tokens per batch "
                     "mean %.0f min %d max %d (%.1f%% of plan.token_budget)", p.epoch + 1, len(p), sh["samples_mean"],
                     sh["samples_min"], sh["samples_max"], sh["tokens_mean"], sh["tokens_min"], sh["tokens_max"],
                     100 * sh["tokens_mean"] / cfg.plan.token_budget)
    return PlanCount([len(p) for p in plans], dict(plans[0].skipped) if plans else {},
                     [plan_digest(p) for p in plans], plans)


def epoch_plan(ds, cfg, epoch: int, expected: int, rank: int, group) -> BatchPlan:
    """Every rank: rank 0 rebuilds the epoch's plan, checks it against the count made at start, and
    broadcasts it on the control group; the others receive it. All return the same plan."""
    plan = None
    if rank == 0:
        plan = plan_for_epoch(ds, cfg, epoch)
        if len(plan) != expected:
            raise RuntimeError(f"epoch {epoch + 1}: plan has {len(plan)} batches, {expected} were counted at start: "
                               "the plan is not a pure function of (seed, epoch)")
    return broadcast_plan(plan, src=0, group=group)
