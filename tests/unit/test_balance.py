from dflash_dist.observe.balance import balance_advice, format_advice
from dflash_dist.parallel.topology import Layout, candidate_splits


def test_drafter_bound_job_gets_more_drafters():
    # 8 ranks/node, 1 drafter: drafter step 70 ms vs target 10 ms per batch -> drafters bottleneck.
    a = balance_advice(target_compute_s=1.0, drafter_compute_s=7.0, batches=100, ranks_per_node=8,
                       drafters_per_node=1, target_wait=0.8, drafter_wait=0.01, splits=candidate_splits(8))
    assert a["bottleneck"] == "drafters"
    # min((8-d)/0.01, d/0.07) is largest at d = 7: 1/0.01 = 100 vs 7/0.07 = 100.
    assert a["suggested_drafters_per_node"] == 7
    assert abs(a["predicted_speedup"] - 7.0) < 1e-9
    assert "suggest roles.drafters_per_node=7" in format_advice(a)


def test_target_bound_job_keeps_few_drafters():
    a = balance_advice(target_compute_s=9.0, drafter_compute_s=1.0, batches=100, ranks_per_node=4,
                       drafters_per_node=1, target_wait=0.0, drafter_wait=0.6, splits=candidate_splits(4))
    assert a["bottleneck"] == "targets" and a["suggested_drafters_per_node"] == 1
    assert "current split is the best" in format_advice(a)
    assert balance_advice(0, 1, 10, 4, 1, 0, 0) == {}


def test_tensor_parallel_advice_is_a_split_the_layout_accepts():
    # The reported run: 4 ranks, model.target.tensor_parallel=2, roles.drafters_per_node=2, drafter-bound.
    # A search over every drafters_per_node said 3 (x1.50), one target rank for a replica of two; the one
    # search (the forecast's too) has 2 as the only split, so the advice is to keep it.
    tp, L = 2, 4
    a = balance_advice(1.0, 7.0, 100, L, 2, 0.8, 0.01, tensor_parallel=tp, splits=candidate_splits(L, tp))
    assert a["suggested_drafters_per_node"] == 2 and a["predicted_speedup"] == 1.0
    assert "current split is the best" in format_advice(a) and "suggest" not in format_advice(a)
    Layout(L, L, a["suggested_drafters_per_node"], tensor_parallel=tp)  # raises TopologyError if refused
    # 8 ranks, tp=2: targets sustain replicas (not ranks) / t_T, so d=6 (one replica) beats d=2 (three) x3.
    a = balance_advice(1.0, 7.0, 100, 8, 2, 0.8, 0.01, tensor_parallel=tp, splits=candidate_splits(8, tp))
    assert a["bottleneck"] == "drafters" and a["suggested_drafters_per_node"] == 6
    assert abs(a["predicted_speedup"] - 3.0) < 1e-9
    Layout(8, 8, 6, tensor_parallel=tp)


def test_no_splits_no_suggestion():
    # Without the layout's splits the advice reports the measurements only: it guesses no split.
    a = balance_advice(1.0, 7.0, 100, 4, 2, 0.8, 0.01, tensor_parallel=2)
    assert a["bottleneck"] == "drafters" and "suggested_drafters_per_node" not in a
    assert "suggest" not in format_advice(a) and "best one" not in format_advice(a)
