"""The anchor rule (objective.draw_anchors, plan.epochs): which samples have an anchor, what a plan
skips, and what a plan with nothing to train says."""
import numpy as np
import pytest
import torch

from dflash_dist.config import ConfigError, load_config
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.plan.epochs import check_trainable, plan_for_epoch
from dflash_dist.training.objective import draw_anchors


def _dataset(lengths, mask_fn, vocab=64):
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    mask = np.concatenate([mask_fn(int(n)) for n in lengths]).astype(np.uint8) if len(lengths) else \
        np.zeros(0, np.uint8)
    return TokenDataset(np.zeros(offsets[-1], dtype=np.int64), offsets, mask, vocab)


def test_samples_supervised_only_at_their_first_token_are_skipped_and_nothing_to_train_is_an_error():
    ds = _dataset([12] * 40, lambda n: np.r_[1, np.zeros(n - 1)])  # no supervised token after the first
    cfg = load_config(None, ["objective.block_size=16", "train.epochs=2"])
    plans = [plan_for_epoch(ds, cfg, e) for e in range(2)]
    assert [len(p) for p in plans] == [0, 0]
    assert plans[0].skipped == {"empty": 0, "no_supervised": 0, "no_anchor": 40, "over_budget": 0}
    with pytest.raises(ConfigError) as e:
        check_trainable([len(p) for p in plans], plans[0].skipped, len(ds))
    assert str(e.value) == ("nothing to train: epoch 1 of 2 has no batch: the plan skips 40 of 40 samples: "
                            "no_anchor 40 (no supervised token after the first: check the loss mask of data.path)")
    # Twelve-token samples with a one-token prompt train at B = 16: anchors p = 0..10, blocks past the end.
    short = _dataset([12] * 40, lambda n: np.r_[0, np.ones(n - 1)])
    assert list(short.num_anchorable) == [11] * 40
    plan = plan_for_epoch(short, cfg, 0)
    assert plan.skipped["no_anchor"] == 0 and len(plan.indices) == 40


@pytest.mark.parametrize("lengths, mask, key", [
    ([], None, "the dataset has no samples (check data.path, or data.synthetic.num_samples)"),
    ([30] * 5, lambda n: np.zeros(n), "no_supervised 5 (no supervised token: check the loss mask of data.path"),
    ([3000] * 5, lambda n: np.ones(n), "over_budget 5 (longer than a batch may hold: raise plan.token_budget"),
    ([0, 0, 3000], lambda n: np.ones(n), "empty 2 (no tokens: check data.path, or data.synthetic.*); over_budget 1"),
])
def test_every_kind_of_nothing_to_train_names_its_counts_and_key(lengths, mask, key):
    ds = _dataset(lengths, mask)
    cfg = load_config(None, ["train.epochs=1"])
    plan = plan_for_epoch(ds, cfg, 0)
    with pytest.raises(ConfigError, match="nothing to train: epoch 1 of 1 has no batch") as e:
        check_trainable([len(plan)], plan.skipped, len(ds))
    assert key in str(e.value)
    check_trainable([3, 2], plan.skipped, len(ds))  # any batch: fine


def test_anchor_positions_are_the_candidates_draw_anchors_picks_from():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 60, 300)
    ds = _dataset(lengths, lambda n: rng.random(n) < 0.3)
    cu = torch.from_numpy(ds.offsets)
    mask = torch.from_numpy(ds.loss_mask.astype(bool))
    _, anchor_cu = draw_anchors(mask, cu, num_anchors=10**6, gen=torch.Generator().manual_seed(0))
    assert np.array_equal(ds.num_anchorable, np.diff(anchor_cu.numpy()))


def test_no_batch_without_an_anchor_even_one_sample_per_batch():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, 400)
    ds = _dataset(lengths, lambda n: np.r_[np.ones(n - n // 2), np.zeros(n // 2)])  # supervised heads only
    cfg = load_config(None, ["objective.block_size=16", "plan.max_seqs=1"])
    plan = plan_for_epoch(ds, cfg, 0)
    anchorable = ds.num_anchorable
    assert plan.skipped["no_anchor"] == int(np.sum(anchorable == 0)) > 0
    assert all(anchorable[plan.batch(b)].sum() > 0 for b in range(len(plan)))
    assert len(plan.indices) + sum(plan.skipped.values()) == len(ds)
