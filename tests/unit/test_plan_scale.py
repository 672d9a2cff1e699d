"""The batch plan at the reference scale (902,000 samples, budget 49,152, 64 sequences per batch)."""
from __future__ import annotations

import numpy as np
import pytest
from corpora import BUDGET, MAX_SEQS, N, chat_lengths

from dflash_dist.plan.epochs import build_plan, epoch_generator, permutation


@pytest.fixture(scope="module")
def data():
    return chat_lengths(N)


@pytest.fixture(scope="module")
def plans(data):
    lengths, sup = data
    return [build_plan(lengths, sup, seed=3, epoch=e, token_budget=BUDGET, max_seqs=MAX_SEQS) for e in range(3)]


def test_every_kept_sample_once_per_epoch(data, plans):
    lengths, _ = data
    skipped = np.zeros(N, dtype=bool)
    skipped[:70] = True
    for plan in plans:
        assert plan.skipped == {"empty": 10, "no_supervised": 20, "no_anchor": 0, "over_budget": 40}
        seen = np.bincount(plan.indices, minlength=N)
        assert np.all(seen[~skipped] == 1) and np.all(seen[skipped] == 0)
        assert plan.offsets[0] == 0 and plan.offsets[-1] == len(plan.indices) == N - 70


def test_budgets_respected_and_packing_is_dense(data, plans):
    lengths, sup = data
    for plan in plans:
        counts = np.diff(plan.offsets)
        assert counts.min() >= 1 and counts.max() <= MAX_SEQS
        tokens = np.add.reduceat(lengths[plan.indices], plan.offsets[:-1])
        assert tokens.max() <= BUDGET
        assert tokens.sum() / (len(plan) * BUDGET) > 0.97  # the fill target with room to spare (98.6%)
    # next-fit: every batch but the last was closed because its next sample did not fit.
    plan = build_plan(lengths, sup, seed=3, epoch=0, token_budget=BUDGET, max_seqs=MAX_SEQS, packing="next_fit")
    counts = np.diff(plan.offsets)
    tokens = np.add.reduceat(lengths[plan.indices], plan.offsets[:-1])
    nxt = lengths[plan.indices[plan.offsets[1:-1]]]
    assert np.all((tokens[:-1] + nxt > BUDGET) | (counts[:-1] == MAX_SEQS))
    assert len(plan) > len(plans[0])


def test_deterministic_and_different_across_epochs(data, plans):
    lengths, sup = data
    again = build_plan(lengths, sup, seed=3, epoch=1, token_budget=BUDGET, max_seqs=MAX_SEQS)
    assert np.array_equal(again.indices, plans[1].indices) and np.array_equal(again.offsets, plans[1].offsets)
    assert not np.array_equal(plans[0].indices, plans[1].indices)
    assert not np.array_equal(plans[1].indices, plans[2].indices)
    other_seed = build_plan(lengths, sup, seed=4, epoch=1, token_budget=BUDGET, max_seqs=MAX_SEQS)
    assert not np.array_equal(other_seed.indices, plans[1].indices)
    assert len({len(p) for p in plans}) > 1  # the batch count changes with the epoch's shuffle


def reference_plan(lengths, supervised, *, seed, epoch, token_budget, max_seqs, max_anchors=0, num_anchors=0):
    """The sample-by-sample greedy loop that build_plan(packing="next_fit") must reproduce exactly."""
    keep = (lengths > 0) & (supervised > 0) & (lengths <= token_budget)
    anchors = np.minimum(supervised, num_anchors)
    if max_anchors > 0:
        keep &= anchors <= max_anchors
    kept = np.flatnonzero(keep)
    batches, cur, tok, anc = [], [], 0, 0
    for i in kept[permutation(len(kept), epoch_generator(seed, epoch))]:  # the plan's shuffle
        a = int(anchors[i]) if max_anchors > 0 else 0
        if cur and (tok + lengths[i] > token_budget or len(cur) == max_seqs or anc + a > max_anchors > 0):
            batches.append(cur)
            cur, tok, anc = [], 0, 0
        cur.append(int(i))
        tok += int(lengths[i])
        anc += a
    if cur:
        batches.append(cur)
    return batches


@pytest.mark.parametrize("budget,max_seqs,max_anchors", [(49_152, 64, 0), (8_192, 8, 0), (49_152, 64, 300),
                                                         (20_000, 1, 0)])
def test_matches_the_per_sample_greedy_loop(budget, max_seqs, max_anchors):
    lengths, sup = chat_lengths(20_000, seed=5)
    kw = dict(seed=1, epoch=2, token_budget=budget, max_seqs=max_seqs, max_anchors=max_anchors, num_anchors=16)
    plan = build_plan(lengths, sup, packing="next_fit", **kw)
    ref = reference_plan(lengths, sup, **kw)
    assert len(plan) == len(ref)
    assert all(plan.batch(b).tolist() == ref[b] for b in range(len(ref)))


