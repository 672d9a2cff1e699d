"""Long samples at the start of a run (plan/long_samples.py): the share of supervised tokens the plan's
skips lose and its refusal, the target's context, and plan.long_samples=truncate (the cut view, its
counts, its anchors, its plans)."""
import logging

import numpy as np
import pytest
import torch

from dflash_dist.config import ConfigError, load_config
from dflash_dist.data.anchors import anchor_candidates
from dflash_dist.data.collate import collate
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.data.digest import dataset_digest
from dflash_dist.data.synthetic import synthetic_dataset
from dflash_dist.plan.epochs import build_plan, plan_digest, plan_for_epoch
from dflash_dist.plan.long_samples import (
    TruncatedDataset,
    check_context,
    check_skipped_share,
    cut_limit,
    plan_figures,
    run_dataset,
)
from dflash_dist.training.objective import block_labels, draw_anchors


def dataset(specs):
    """specs: (length, prompt tokens) per sample; the rest of each sample is supervised."""
    offsets = np.concatenate([[0], np.cumsum([n for n, _ in specs])]).astype(np.int64)
    mask = np.concatenate([np.r_[np.zeros(p), np.ones(n - p)] for n, p in specs]).astype(np.uint8)
    tokens = np.arange(offsets[-1], dtype=np.int64) % 97
    return TokenDataset(tokens=tokens, offsets=offsets, loss_mask=mask, vocab_size=128)


def cfg_of(*overrides):
    return load_config(None, list(overrides))


# Five short samples (30 supervised tokens each) and two long ones (90 and 190 supervised).
SPECS = [(40, 10)] * 5 + [(100, 10), (200, 10)]


def test_the_share_of_supervised_tokens_skipped_and_the_budget_that_keeps_all():
    ds = dataset(SPECS)
    f = plan_figures(ds, cfg_of("plan.token_budget=64"), context=40960)
    assert f["supervised_tokens"] == 5 * 30 + 90 + 190
    assert f["skipped_samples"] == 2 and f["skipped_supervised_tokens"] == 90 + 190
    assert f["skipped_supervised_share"] == pytest.approx(280 / 430)
    assert f["token_budget_keeping_all"] == 200 and f["over_budget_by_length"] == 2
    assert f["truncated_samples"] == 0 and f["long_samples"] == "skip"
    f = plan_figures(ds, cfg_of("plan.token_budget=200"), context=40960)
    assert f["skipped_supervised_tokens"] == 0 and f["token_budget_keeping_all"] is None


def test_over_the_bounded_share_refuses_naming_the_share_and_the_budget():
    f = plan_figures(dataset(SPECS), cfg_of("plan.token_budget=64"), context=40960)
    with pytest.raises(ConfigError) as e:
        check_skipped_share(f)
    msg = str(e.value)
    assert "plan.max_skipped_share" in msg and "65.1%" in msg and "plan.token_budget=200" in msg
    assert "plan.long_samples=truncate" in msg


def test_under_the_share_is_a_warning_and_none_is_silent(caplog):
    ds = dataset([(40, 10)] * 60 + [(100, 10)])  # 90 of 1890 supervised tokens: 4.8%
    f = plan_figures(ds, cfg_of("plan.token_budget=64"), context=40960)
    assert f["skipped_supervised_share"] == pytest.approx(90 / 1890)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.plan.long_samples"):
        check_skipped_share(f)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    caplog.clear()
    with pytest.raises(ConfigError):
        check_skipped_share(plan_figures(ds, cfg_of("plan.token_budget=64", "plan.max_skipped_share=0.04"),
                                         context=40960))
    with caplog.at_level(logging.WARNING, logger="dflash_dist.plan.long_samples"):
        check_skipped_share(plan_figures(ds, cfg_of("plan.token_budget=100"), context=40960))
    assert not caplog.records


def test_the_anchor_cap_skips_count_and_name_their_key():
    ds = dataset([(40, 10)] * 4)  # each sample: 29 anchor candidates, capped at num_anchors=16
    f = plan_figures(ds, cfg_of("plan.max_anchors=8"), context=40960)
    assert f["skipped_supervised_share"] == 1.0 and f["token_budget_keeping_all"] is None
    with pytest.raises(ConfigError, match="plan.max_anchors"):
        check_skipped_share(f)


def test_the_default_job_skips_nothing():
    """The synthetic corpus under the schema's defaults: no warning, no refusal, nothing cut."""
    cfg = cfg_of()
    f = plan_figures(synthetic_dataset(cfg.data.synthetic, cfg.model.target.vocab_size), cfg, context=40960)
    assert f["skipped_supervised_tokens"] == 0 and f["over_context_samples"] == 0 and f["truncated_samples"] == 0


def test_samples_past_the_targets_context_are_refused_under_skip():
    ds = dataset(SPECS)
    cfg = cfg_of("plan.token_budget=512")
    f = plan_figures(ds, cfg, context=150)
    assert f["over_context_samples"] == 1 and f["longest_sample"] == 200
    with pytest.raises(ConfigError) as e:
        check_context(f, cfg, "t/config.json")
    msg = str(e.value)
    assert "data.synthetic.*" in msg and "max_position_embeddings 150" in msg and "plan.long_samples=truncate" in msg
    check_context(plan_figures(ds, cfg_of("plan.token_budget=512"), context=200), cfg, "t")  # fits exactly
    tcfg = cfg_of("plan.token_budget=512", "plan.long_samples=truncate")
    view = run_dataset(ds, tcfg, context=150)
    f = plan_figures(view, tcfg, context=150)
    check_context(f, tcfg, "t")  # truncated to the context instead
    assert f["truncate_limit"] == 150 and int(view.lengths.max()) == 150


def test_truncate_keeps_each_long_samples_first_tokens_and_counts_the_rest():
    ds = dataset(SPECS)
    cfg = cfg_of("plan.token_budget=64", "plan.long_samples=truncate")
    view = run_dataset(ds, cfg, context=40960)
    assert isinstance(view, TruncatedDataset) and cut_limit(64, 40960) == 64
    assert view.lengths.tolist() == [40] * 5 + [64, 64]
    for i in range(len(ds)):
        t, m = view.sample(i)
        t0, m0 = ds.sample(i)
        n = min(len(t0), 64)
        assert np.array_equal(t, t0[:n]) and np.array_equal(m, m0[:n])
    assert view.num_supervised.tolist() == [30] * 5 + [54, 54]
    assert view.num_anchorable.tolist() == [30] * 5 + [54, 54]  # the first token is a prompt token
    assert dataset_digest(view) == dataset_digest(ds)  # the data is the same; the cut is the plan's
    f = plan_figures(view, cfg, context=40960)
    assert f["skipped_supervised_tokens"] == 0 and f["truncated_samples"] == 2
    assert f["truncated_tokens"] == 36 + 136 and f["truncated_supervised_tokens"] == 36 + 136
    check_skipped_share(f)  # nothing skipped: no refusal


def test_the_view_keeps_the_preparations_record():
    from dflash_dist.data.dataset import preparation_skips
    from dflash_dist.data.disk import DiskDataset
    ds = dataset(SPECS)
    cfg = cfg_of("plan.token_budget=64", "plan.long_samples=truncate")
    disk = DiskDataset(ds.tokens, ds.offsets, ds.loss_mask, ds.vocab_size, meta={"skipped": {"over_length": 3}})
    assert preparation_skips(run_dataset(disk, cfg, 40960)) == {"over_length": 3}
    assert preparation_skips(run_dataset(ds, cfg, 40960)) == {}


def test_no_view_unless_truncate_cuts_something():
    ds = dataset(SPECS)
    assert run_dataset(ds, cfg_of("plan.token_budget=64"), context=40960) is ds
    assert run_dataset(ds, cfg_of("plan.token_budget=200", "plan.long_samples=truncate"), context=40960) is ds


def test_a_cut_that_leaves_no_supervised_token_is_skipped_and_counted():
    ds = dataset([(40, 10), (100, 70)])  # sample 1's kept 64 tokens are all prompt
    cfg = cfg_of("plan.token_budget=64", "plan.long_samples=truncate", "plan.max_skipped_share=1")
    f = plan_figures(run_dataset(ds, cfg, context=40960), cfg, context=40960)
    assert f["skipped_by_reason"]["no_supervised"] == 1 and f["skipped_supervised_tokens"] == 0
    assert f["truncated_supervised_tokens"] == 30


def test_truncated_plans_hold_every_sample_and_rebuild_identically():
    """Resume-exact: the view and its plans are a pure function of (data, seed, epoch, budgets)."""
    rng = np.random.default_rng(0)
    specs = [(int(n), int(n) // 3) for n in rng.integers(20, 300, 400)]
    cfg = cfg_of("plan.token_budget=128", "plan.long_samples=truncate", "plan.max_seqs=8")
    a, b = run_dataset(dataset(specs), cfg, 40960), run_dataset(dataset(specs), cfg, 40960)
    for epoch in range(3):
        pa, pb = plan_for_epoch(a, cfg, epoch), plan_for_epoch(b, cfg, epoch)
        assert plan_digest(pa) == plan_digest(pb)
        assert sum(pa.skipped.values()) == 0 and sorted(pa.indices.tolist()) == list(range(400))
        assert all(a.lengths[pa.batch(k)].sum() <= 128 for k in range(len(pa)))
    skip_plan = build_plan(dataset(specs).lengths, dataset(specs).num_supervised, seed=0, epoch=0,
                           token_budget=128, max_seqs=8)
    assert skip_plan.skipped["over_budget"] > 0  # the same data under skip loses samples


def test_anchors_of_a_cut_sample_lie_in_its_kept_tokens():
    """The rule on the kept tokens: an anchor's next token is kept and supervised, and no block slot is
    labelled from a dropped token (slots past the cut carry no label, as past a sample's end)."""
    ds = dataset([(100, 10), (200, 10)])
    view = run_dataset(ds, cfg_of("plan.token_budget=64", "plan.long_samples=truncate"), context=40960)
    batch = collate(view, np.array([0, 1]))
    assert batch.cu_seqlens.tolist() == [0, 64, 128]
    anchors, anchor_cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, 200, torch.Generator().manual_seed(0))
    assert anchor_cu.tolist() == [0, 54, 108]  # every candidate of the kept tokens: 54 per sample
    for s in range(2):
        a = anchors[anchor_cu[s]:anchor_cu[s + 1]] - 64 * s
        assert torch.equal(a, anchor_candidates(batch.loss_mask[64 * s:64 * (s + 1)]))
        assert int(a.max()) == 62  # the last kept token's predecessor
    labels, weights = block_labels(batch.input_ids, batch.loss_mask, batch.cu_seqlens, anchors, anchor_cu, 16, 7.0)
    pos = anchors[:, None] + torch.arange(16)
    end = torch.repeat_interleave(batch.cu_seqlens[1:], anchor_cu[1:] - anchor_cu[:-1])[:, None]
    assert bool(((labels != -100) <= (pos < end)).all()) and bool(((weights > 0) <= (pos < end)).all())
    trained = labels[labels != -100]
    assert torch.equal(trained, batch.input_ids[pos[labels != -100]])


@pytest.mark.parametrize("override,key", [("plan.long_samples=cut", "plan.long_samples"),
                                          ("plan.max_skipped_share=1.5", "plan.max_skipped_share"),
                                          ("plan.max_skipped_share=-0.1", "plan.max_skipped_share")])
def test_the_new_keys_are_checked(override, key):
    with pytest.raises(ConfigError, match=key):
        cfg_of(override)
    assert cfg_of().plan.long_samples == "skip" and cfg_of().plan.max_skipped_share == 0.05
