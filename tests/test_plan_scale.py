"""The batch plan at the reference scale (902,000 samples, budget 49,152, 64 sequences per batch)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_dist.plan.epochs import build_plan, epoch_generator, permutation

N, BUDGET, MAX_SEQS = 902_000, 49_152, 64


def chat_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Log-normal chat lengths (median ~1.2K) with a few samples of every skip reason."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.exp(rng.normal(np.log(1200), 1.0, n)), BUDGET - 1).astype(np.int64) + 1
    supervised = (lengths * rng.uniform(0.5, 0.8, n)).astype(np.int64) + 1
    lengths[:40] = BUDGET + 1 + np.arange(40)  # over budget
    lengths[40:50] = supervised[40:50] = 0  # empty
    supervised[50:70] = 0  # nothing to learn
    return lengths, supervised


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


def test_bench_helpers_and_smoke(tmp_path, capsys):
    from dflash_dist.bench import plan as bench
    lengths, sup = chat_lengths(20_000, seed=6)
    plan = build_plan(lengths, sup, seed=0, epoch=0, token_budget=BUDGET, max_seqs=MAX_SEQS, packing="next_fit")
    # The sorted reference packs with exactly next-fit, only in another order.
    assert np.array_equal(bench.greedy_offsets(lengths[plan.indices], BUDGET, MAX_SEQS), plan.offsets)
    # Padded: [5, 3 | 9 | 2, 2, 2] under 10 padded tokens: (2x5) + (1x9) + (3x2) = 25 computed tokens.
    assert bench.padded_batches(np.array([5, 3, 9, 2, 2, 2]), 10, 4) == (3, 25)
    assert bench.padded_batches(np.array([1] * 5), 10, 2) == (3, 5)  # max_seqs cuts before the budget

    out = tmp_path / "plan.json"
    assert bench.main(["--samples", "20000", "--epochs", "2", "--ranks", "2", "--reps", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "| epoch | build s" in capsys.readouterr().out
    assert [r["epoch"] for r in res["plan"]] == [0, 1] and res["skipped"]["over_budget"] == 1
    assert res["padded"][0]["extra_compute"] > 1 and res["broadcast"]["ranks"] == 2
    assert res["broadcast"]["indices"] == 20_000 - 1
