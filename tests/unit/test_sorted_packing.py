"""plan.packing=sorted: the seed's fixed length-sorted batches, in a new order every epoch."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_dist.config import ConfigError, load_config
from dflash_dist.plan.epochs import build_plan


def _corpus(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 400, size=n)
    lengths[:5] = [0, 5000, 3, 7, 2]  # an empty one, one over the budget
    supervised = np.maximum(lengths - 4, 0)
    return lengths, supervised, np.maximum(lengths - 2, 0)


def _plans(epochs=3, **kw):
    lengths, supervised, anchorable = _corpus()
    args = dict(seed=5, token_budget=2048, max_seqs=16, packing="sorted", anchorable=anchorable) | kw
    return lengths, [build_plan(lengths, supervised, epoch=e, **args) for e in range(epochs)]


def _batches(plan):
    return [tuple(sorted(plan.batch(b).tolist())) for b in range(len(plan))]


@pytest.mark.parametrize("caps", [{}, {"max_anchors": 300, "num_anchors": 16}])
def test_same_batches_every_epoch_in_a_new_order(caps):
    lengths, plans = _plans(**caps)
    counts = {len(p) for p in plans}
    assert len(counts) == 1 and counts.pop() > 10
    assert len({frozenset(_batches(p)) for p in plans}) == 1  # the same batches...
    assert len({tuple(_batches(p)) for p in plans}) == 3  # ...in another order each epoch
    for p in plans:
        assert sorted(p.indices.tolist()) == sorted(set(p.indices.tolist()))  # no sample twice
        assert p.skipped["empty"] == 1 and p.skipped["over_budget"] == 1
        assert len(p.indices) == len(lengths) - sum(p.skipped.values())
        assert max(lengths[p.batch(b)].sum() for b in range(len(p))) <= 2048
        assert max(len(p.batch(b)) for b in range(len(p))) <= 16
    if caps:
        anchors = np.minimum(_corpus()[2], 16)
        assert max(anchors[plans[0].batch(b)].sum() for b in range(len(plans[0]))) <= 300


def test_batches_hold_one_length_range_each():
    """Sorted by length once: batches cover disjoint, increasing length ranges (batch 0 the shortest)."""
    lengths, (plan,) = _plans(epochs=1)
    ranges = sorted((lengths[plan.batch(b)].min(), lengths[plan.batch(b)].max()) for b in range(len(plan)))
    assert all(hi <= nxt_lo for (_, hi), (nxt_lo, _) in zip(ranges, ranges[1:]))
    assert ranges[0][1] < np.median(lengths) < ranges[-1][0]
    # fill mixes lengths in every batch: its batches span far wider ranges
    fill = build_plan(lengths, np.maximum(lengths - 4, 0), seed=5, epoch=0, token_budget=2048, max_seqs=16)
    spread = np.median([np.ptp(lengths[fill.batch(b)]) for b in range(len(fill))])
    assert spread > 4 * np.median([hi - lo for lo, hi in ranges])


def test_config_accepts_sorted_and_names_the_choices():
    assert load_config(None, ["plan.packing=sorted"]).plan.packing == "sorted"
    with pytest.raises(ConfigError, match=r"plan.packing.*'fill', 'next_fit', 'sorted'"):
        load_config(None, ["plan.packing=shortest_first"])
