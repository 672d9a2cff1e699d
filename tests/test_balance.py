from dflash_dist.observe.balance import balance_advice, format_advice


def test_drafter_bound_job_gets_more_drafters():
    # 8 ranks/node, 1 drafter: drafter step 70 ms vs target 10 ms per batch -> drafters bottleneck.
    a = balance_advice(target_compute_s=1.0, drafter_compute_s=7.0, batches=100, ranks_per_node=8,
                       drafters_per_node=1, target_wait=0.8, drafter_wait=0.01)
    assert a["bottleneck"] == "drafters"
    # min((8-d)/0.01, d/0.07) is largest at d = 7: 1/0.01 = 100 vs 7/0.07 = 100.
    assert a["suggested_drafters_per_node"] == 7
    assert abs(a["predicted_speedup"] - 7.0) < 1e-9
    assert "suggest roles.drafters_per_node=7" in format_advice(a)


def test_target_bound_job_keeps_few_drafters():
    a = balance_advice(target_compute_s=9.0, drafter_compute_s=1.0, batches=100, ranks_per_node=4,
                       drafters_per_node=1, target_wait=0.0, drafter_wait=0.6)
    assert a["bottleneck"] == "targets" and a["suggested_drafters_per_node"] == 1
    assert "current split is the best" in format_advice(a)
    assert balance_advice(0, 1, 10, 4, 1, 0, 0) == {}
