"""The step stats drafters all-reduce: one packing, named fields, device tensors and host numbers alike,
and a variant's declared figures carried by name through the chunks' merge, the packing and the reduce."""
import pytest
import torch

from dflash_dist.models.variants import Figures
from dflash_dist.observe.monitor import wait_fraction
from dflash_dist.training import step as step_module
from dflash_dist.training.objective import StepMetrics
from dflash_dist.training.stats import StepStats
from dflash_dist.training.step import merge_metrics, reduce_stats


def test_pack_and_unpack_round_trip_with_tensor_and_number_fields():
    s = StepStats(block_size=4, loss_sum=torch.tensor(2.5), weight_sum=torch.tensor(5.0), tokens=300, seqs=3,
                  accept_sum=torch.tensor(7.0), blocks=4, batches=1, wait_s=0.25, compute_s=1.5, save_due=1,
                  correct=torch.tensor([0, 3, 2, 1]), valid=torch.tensor([0, 4, 4, 2]))
    t = s.pack(torch.device("cpu"))
    assert t.dtype == torch.float64 and t.shape == (10 + 2 * 4,)  # 10 scalars, 2 per-slot vectors (no figures)
    # What an all-reduce over two drafters with the same stats gives.
    u = StepStats.unpack(t * 2, 4)
    assert (u.loss_sum, u.weight_sum, u.tokens, u.seqs, u.accept_sum, u.blocks, u.batches) == (5.0, 10.0, 600, 6, 14.0,
                                                                                                8, 2)
    assert (u.wait_s, u.compute_s, u.save_due) == (0.5, 3.0, 2) and isinstance(u.tokens, int)
    assert u.correct.tolist() == [0, 6, 4, 2] and u.valid.tolist() == [0, 8, 8, 4]
    assert u.loss == 0.5 and u.accuracy() == [0.75, 0.5, 0.5]


def test_an_idle_drafter_packs_zeros():
    t = StepStats(block_size=3, wait_s=0.1).pack(torch.device("cpu"))
    assert t[:7].sum() == 0 and t[7] == 0.1 and t[10:].sum() == 0


def test_wait_fraction():
    assert wait_fraction(1.0, 3.0) == 0.25 and wait_fraction(0.0, 0.0) == 0.0


# A toy declaration: two scalar sums and one per-slot vector, none of them any built-in variant's.
TOY = Figures(scalars=("toy_a", "toy_b"), slots=("toy_hits",))


def toy_metrics(scale: float) -> StepMetrics:
    """One anchor chunk's metrics with the toy sums (tensors, as a step leaves them on its device)."""
    return StepMetrics(loss_sum=torch.tensor(1.0 * scale), weight_sum=torch.tensor(2.0), correct=torch.tensor([0, 1, 2]),
                       valid=torch.tensor([0, 2, 2]), accept_sum=torch.tensor(3.0), num_blocks=2,
                       sums={"toy_a": torch.tensor(0.5 * scale), "toy_b": 4.0, "toy_hits": torch.tensor([0, 2, 1])})


def test_declared_figures_ride_through_the_merge_the_packing_and_the_reduce(monkeypatch):
    """Two chunks merged (drafter_step's merge), packed after the fixed fields in the declared order,
    all-reduced with a second drafter's stats (the all-reduce's sum, in process) and unpacked by the
    declaration: every sum by its name, the fixed fields untouched by them."""
    m = merge_metrics([toy_metrics(1.0), toy_metrics(2.0)])
    assert float(m.sums["toy_a"]) == 1.5 and m.sums["toy_b"] == 8.0 and m.sums["toy_hits"].tolist() == [0, 4, 2]
    mine, other = StepStats(3, figures=TOY), StepStats(3, figures=TOY)
    mine.take_metrics(m)
    other.take_metrics(toy_metrics(1.0))
    t = mine.pack(torch.device("cpu"))
    assert t.shape == (10 + 2 + 3 * 3,) and t[10:12].tolist() == [1.5, 8.0] and t[-3:].tolist() == [0, 4, 2]
    monkeypatch.setattr(step_module.dist, "all_reduce", lambda x, group=None: x.add_(other.pack(x.device)))
    total = reduce_stats(mine, None, torch.device("cpu"))
    assert total.figures == TOY and total.sums["toy_a"] == 2.0 and total.sums["toy_b"] == 12.0
    assert total.sums["toy_hits"].tolist() == [0, 6, 3]
    assert (total.loss_sum, total.weight_sum, total.accept_sum, total.blocks) == (4.0, 6.0, 9.0, 6)
    assert total.correct.tolist() == [0, 3, 6] and total.valid.tolist() == [0, 6, 6]
    # the generic ratios a variant reports them by: over the drafting slots' labels, per block, per weight
    assert (total.slot_ratio("toy_hits"), total.per_block("toy_b"), total.per_weight("toy_a")) == (9 / 12, 2.0, 1 / 3)
    idle = StepStats.unpack(StepStats(3, figures=TOY).pack(torch.device("cpu")), 3, TOY)  # a tail drafter's
    assert idle.sums["toy_a"] == 0.0 and idle.sums["toy_hits"].tolist() == [0, 0, 0]
    assert idle.slot_ratio("toy_hits") != idle.slot_ratio("toy_hits")  # nan: no labels
    assert idle.per_block("toy_b") != idle.per_block("toy_b") and idle.per_weight("toy_a") != idle.per_weight("toy_a")


def test_sums_other_than_the_declared_ones_are_refused():
    """A loss term's sum that its variant does not declare would vanish in the packing, a declared one
    it does not return would report zeros: both refused, naming the sums."""
    with pytest.raises(ValueError, match="toy_a.*Variant.figures"):
        StepStats(3).take_metrics(toy_metrics(1.0))
    with pytest.raises(ValueError, match="toy_c"):
        StepStats(3, figures=Figures(scalars=("toy_a", "toy_b", "toy_c"), slots=("toy_hits",))).take_metrics(
            toy_metrics(1.0))
