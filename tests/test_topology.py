import pytest

from dflash_dist.topology import Layout, TopologyError


@pytest.mark.parametrize("world, local, d", [(3, 3, 1), (4, 4, 2), (8, 8, 1), (8, 8, 5), (5, 5, 3), (16, 8, 2), (16, 8, 1)])
def test_routes_cover_every_batch_once_in_increasing_pair_order(world, local, d):
    lay = Layout(world, local, d)
    n = 97
    seen_pairs: dict = {}
    for b in range(n):
        t, dr = lay.route(b)
        assert lay.role(t) == "target" and lay.role(dr) == "drafter"
        assert t // local == dr // local, "features must not cross nodes"
        seen_pairs.setdefault((t, dr), []).append(b)
    for batches in seen_pairs.values():
        assert batches == sorted(batches)
    # Each batch is handled by exactly one target and one drafter, as those ranks enumerate it.
    for rank in range(world):
        for b in lay.batches_of(rank, n):
            assert rank in lay.route(b)
    tgt = sorted(b for r in lay.target_ranks() for b in lay.batches_of(r, n))
    drf = sorted(b for r in lay.drafter_ranks() for b in lay.batches_of(r, n))
    assert tgt == drf == list(range(n))


def test_single_node_rule_is_b_mod_t_and_b_mod_d():
    lay = Layout(8, 8, 3)  # drafters 0,1,2; targets 3..7
    for b in range(50):
        assert lay.route(b) == (3 + b % 5, b % 3)


def test_rank0_is_drafter0_and_drafter_step_is_one_batch_per_drafter():
    lay = Layout(16, 8, 2)
    assert lay.drafter_ranks() == [0, 1, 8, 9]
    assert lay.drafter_index(0) == 0 and lay.drafter_index(9) == 3
    assert lay.num_steps(10) == 3 and lay.tail(10) == 2 and lay.tail(12) == 0


def test_two_nodes_of_eight_gpus():
    lay = Layout(16, 8, 2)
    assert lay.num_nodes == 2 and lay.num_targets == 12 and lay.target_ranks() == [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    # Node 1's drafters only ever hear from node 1's targets.
    for b in range(200):
        t, d = lay.route(b)
        assert (t >= 8) == (d >= 8)


@pytest.mark.parametrize("world, local, d", [(4, 4, 4), (4, 4, 0), (6, 4, 1)])
def test_bad_layouts_are_refused(world, local, d):
    with pytest.raises(TopologyError):
        Layout(world, local, d)
