"""The step stats drafters all-reduce: one packing, named fields, device tensors and host numbers alike."""
import torch

from dflash_dist.observe.monitor import wait_fraction
from dflash_dist.training.stats import StepStats


def test_pack_and_unpack_round_trip_with_tensor_and_number_fields():
    s = StepStats(block_size=4, loss_sum=torch.tensor(2.5), weight_sum=torch.tensor(5.0), tokens=300, seqs=3,
                  accept_sum=torch.tensor(7.0), blocks=4, batches=1, wait_s=0.25, compute_s=1.5, save_due=1,
                  correct=torch.tensor([0, 3, 2, 1]), valid=torch.tensor([0, 4, 4, 2]))
    t = s.pack(torch.device("cpu"))
    assert t.dtype == torch.float64 and t.shape == (14 + 4 * 4,)  # 14 scalars, 4 per-slot vectors (DFlash 2, Domino: 2)
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
