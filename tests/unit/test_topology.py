import pytest

from dflash_dist.parallel.topology import Layout, TopologyError


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


# Replicas of several ranks (model.target.tensor_parallel) and resumes from a mid-epoch origin.
REPLICA_LAYOUTS = [  # (world, ranks per node, drafters per node, ranks per replica)
    (3, 3, 1, 1), (8, 8, 3, 1), (5, 5, 1, 2), (8, 8, 2, 2), (8, 8, 4, 2), (8, 8, 6, 2), (9, 9, 1, 4),
    (8, 8, 4, 4), (16, 8, 2, 2), (24, 8, 4, 4), (32, 8, 2, 3), (16, 8, 6, 1),
]


@pytest.mark.parametrize("world, local, d, tp", REPLICA_LAYOUTS)
@pytest.mark.parametrize("origin", [0, 1, 7, 40])
def test_replica_routes_cover_every_batch_once(world, local, d, tp, origin):
    lay = Layout(world, local, d, tensor_parallel=tp)
    n = 101
    assert lay.num_replicas * tp == lay.num_targets == len(lay.target_ranks())
    pairs: dict = {}
    for b in range(origin, n):
        leader, dr = lay.route(b, origin)
        assert lay.is_replica_leader(leader) and lay.role(dr) == "drafter"
        assert leader // local == dr // local, "features must not cross nodes"
        assert dr == lay.drafter_ranks()[(b - origin) % lay.num_drafters]
        pairs.setdefault((leader, dr), []).append(b)
    for batches in pairs.values():
        assert batches == sorted(batches)
    # Every rank of a replica runs exactly its replica's batches; leaders together run each batch once.
    for r, ranks in enumerate(lay.replica_groups()):
        runs = [lay.batches_of(rank, n, origin) for rank in ranks]
        assert all(x == runs[0] for x in runs)
        assert runs[0] == [b for b in range(origin, n) if lay.route(b, origin)[0] == lay.replica_leader(r)]
    by_leader = sorted(b for r in range(lay.num_replicas) for b in lay.batches_of(lay.replica_leader(r), n, origin))
    by_drafter = sorted(b for rank in lay.drafter_ranks() for b in lay.batches_of(rank, n, origin))
    assert by_leader == by_drafter == list(range(origin, n))
    for rank in range(world):
        for b in lay.batches_of(rank, n, origin):
            leader, dr = lay.route(b, origin)
            assert rank == dr or (lay.role(rank) == "target" and lay.replica_of(rank) == lay.replica_of(leader))
    # A node's replicas share its batches round-robin: their counts differ by at most one.
    for node in range(lay.num_nodes):
        counts = [len(lay.batches_of(lay.replica_leader(node * lay.replicas_per_node + i), n, origin))
                  for i in range(lay.replicas_per_node)]
        assert max(counts) - min(counts) <= 1
    # Steps and idle drafters count the batches left from the origin.
    assert lay.num_steps(n, origin) * lay.num_drafters - lay.tail(n, origin) == n - origin


@pytest.mark.parametrize("world, local, d, tp", REPLICA_LAYOUTS)
def test_replicas_partition_the_target_ranks_of_each_node(world, local, d, tp):
    lay = Layout(world, local, d, tensor_parallel=tp)
    groups = lay.replica_groups()
    assert sorted(r for g in groups for r in g) == lay.target_ranks()
    for r, g in enumerate(groups):
        assert g == list(range(g[0], g[0] + tp)) and g[0] // local == g[-1] // local  # one node, consecutive
        assert lay.replica_leader(r) == g[0] and [lay.replica_of(x) for x in g] == [r] * tp
        assert [lay.is_replica_leader(x) for x in g] == [True] + [False] * (tp - 1)
    assert not any(lay.is_replica_leader(x) for x in lay.drafter_ranks())
    with pytest.raises(TopologyError, match="drafter"):
        lay.replica_of(0)


def test_eight_gpus_two_drafters_three_replicas_of_two():
    lay = Layout(8, 8, 2, tensor_parallel=2)
    assert lay.replica_groups() == [[2, 3], [4, 5], [6, 7]] and lay.num_targets == 6 and lay.num_replicas == 3
    for b in range(60):
        assert lay.route(b) == (2 + 2 * (b % 3), b % 2)
    assert lay.batches_of(3, 10) == lay.batches_of(2, 10) == [0, 3, 6, 9]


def test_one_rank_replicas_route_as_before_and_origin_restarts_the_round_robin():
    for lay in (Layout(16, 8, 2), Layout(16, 8, 2, tensor_parallel=3), Layout(4, 4, 1, colocated=True)):
        for b in range(50):
            assert lay.route(b, 0) == lay.route(b)
            # A resumed epoch is routed like a fresh epoch of its remaining batches.
            assert lay.route(13 + b, origin=13) == lay.route(b)
        assert lay.batches_of(0, 50, origin=13) == [13 + b for b in lay.batches_of(0, 37)]
    lay = Layout(16, 8, 2)
    with pytest.raises(TopologyError, match="precedes the origin"):
        lay.route(3, origin=4)
    # With one rank per replica, replicas are the target ranks themselves.
    assert lay.replica_groups() == [[r] for r in lay.target_ranks()]
    assert Layout(4, 4, 1, colocated=True).replica_groups() == [[0], [1], [2], [3]]


@pytest.mark.parametrize("world, local, d, tp, keys", [
    (8, 8, 1, 2, ["model.target.tensor_parallel", "roles.drafters_per_node"]),  # 7 target ranks, replicas of 2
    # 6 target ranks per node: a replica of 4 would span nodes
    (16, 8, 2, 4, ["model.target.tensor_parallel", "roles.drafters_per_node"]),
    (8, 8, 2, 0, ["model.target.tensor_parallel"]),
])
def test_impossible_replica_layouts_are_refused_naming_the_keys(world, local, d, tp, keys):
    with pytest.raises(TopologyError) as err:
        Layout(world, local, d, tensor_parallel=tp)
    assert all(k in str(err.value) for k in keys)


def test_colocated_replicas_of_several_ranks_are_refused():
    with pytest.raises(TopologyError, match="model.target.tensor_parallel"):
        Layout(4, 4, 1, colocated=True, tensor_parallel=2)
