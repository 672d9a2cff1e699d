"""The plan-scale bench (spawned worker processes) at the reference scale: its helpers and a smoke run."""
from __future__ import annotations

import json

import numpy as np
from corpora import BUDGET, MAX_SEQS, chat_lengths

from dflash_dist.plan.epochs import build_plan


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
