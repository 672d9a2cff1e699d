"""The epoch schedule both roles walk: every batch from the origin on trained once, routes, vote points."""
import pytest

from dflash_dist.parallel.topology import Layout
from dflash_dist.plan.schedule import EpochSchedule, Votes


@pytest.mark.parametrize("n, origin, D", [(10, 0, 1), (10, 0, 3), (11, 4, 2), (7, 6, 3), (64, 13, 5), (5, 5, 2)])
def test_every_batch_from_the_origin_is_trained_once(n, origin, D):
    s = EpochSchedule(epoch=0, num_batches=n, origin=origin, num_drafters=D, sync_every=2)
    seen = [s.batch(step, j) for step in range(s.steps) for j in range(D)]
    trained = [b for b in seen if b is not None]
    assert trained == list(range(origin, n))
    assert sum(s.real(step) for step in range(s.steps)) == n - origin
    assert s.idle() == seen.count(None) and all(s.step_of(b) == i // D for i, b in enumerate(seen) if b is not None)
    assert s.next_batch(0) == origin and s.next_batch(s.steps) == n


@pytest.mark.parametrize("world, local, d, origin", [(3, 3, 1, 0), (4, 4, 2, 5), (8, 4, 1, 3), (6, 6, 4, 1)])
def test_routes_pair_each_batch_with_its_drafter_and_one_target(world, local, d, origin):
    lay = Layout(world, local, d)
    s = EpochSchedule(0, 40, origin, lay.num_drafters, 2)
    by_target = {r: s.target_batches(lay, r) for r in lay.target_ranks()}
    assert sorted(b for bs in by_target.values() for b in bs) == list(range(origin, 40))
    for t, bs in by_target.items():
        assert bs == sorted(bs) and all(s.route(lay, b)[0] == t for b in bs)
    for step in range(s.steps):
        for j, rank in enumerate(lay.drafter_ranks()):
            b = s.batch(step, j)
            if b is not None:
                assert s.route(lay, b)[1] == rank
                # Features stay on the drafter's node.
                assert s.route(lay, b)[0] // local == rank // local


class FakeAgreement:
    def __init__(self, stop_at=None):
        self.stop_at, self.asked = stop_at, []

    def boundary(self, k):
        self.asked.append(k)
        return k == self.stop_at

    def decided(self, k):
        return k == self.stop_at

    def finish(self):
        return False


def test_votes_are_passed_in_order_at_the_same_steps_by_every_walker():
    s = EpochSchedule(0, 23, 0, 2, sync_every=3)  # 12 steps: boundaries at steps 3, 6, 9
    drafter, target = FakeAgreement(), FakeAgreement()
    dv, tv = Votes(s, drafter), Votes(s, target)
    for step in range(s.steps):
        assert not dv.reach(step)
    for b in [1, 9, 10, 20]:  # a target reaches only the steps of its own batches
        assert not tv.reach(s.step_of(b))
    assert not tv.reach(s.steps - 1)
    assert drafter.asked == target.asked == [1, 2, 3]


def test_a_stop_lands_on_the_same_step_for_drafters_and_targets():
    s = EpochSchedule(0, 30, 4, 2, sync_every=2)
    dv, tv = Votes(s, FakeAgreement(stop_at=2)), Votes(s, FakeAgreement(stop_at=2))
    d_stop = next(step for step in range(s.steps) if dv.reach(step))
    assert tv.reach(s.step_of(26)) and tv.stop_step() == d_stop == 4
    assert s.next_batch(d_stop) == 4 + 4 * 2
    assert dv.stops_by(4) and not dv.stops_by(3)
