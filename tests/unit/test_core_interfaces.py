"""The core's declared interfaces and its one-source facts: the variant registry against the config's
choices and the export contract, the step settings' one constructor, the anchor rule counted and drawn
alike, the accepted length, the target kinds, the optimizer step's non-finite skip, the progress line's
two named figures."""
from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from dflash_dist.config import Config, ConfigError, ObjectiveConfig, choices, load_config
from dflash_dist.data.anchors import anchor_candidates, anchors_per_sample, count_anchorable, tail_anchorable
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.models.build import build_target, draft_spec
from dflash_dist.models.export import export_config, spec_from_export
from dflash_dist.models.variants import VARIANTS, accepted_lengths, check_objective, variant_of
from dflash_dist.observe.monitor import Progress, format_line, snapshot
from dflash_dist.training.objective import draw_anchors
from dflash_dist.training.step import step_settings

CPU = torch.device("cpu")


def test_the_variant_registry_alone_decides_the_variant_names():
    # config.py names no variant: the key is free text, refused right after loading by the registry
    assert "model.draft.variant" not in choices()
    with pytest.raises(ConfigError, match="model.draft.variant"):
        variant_of("medusa")
    with pytest.raises(ConfigError, match="'model.draft.variant': 'medusa' is not one of dflash, dflash2"):
        check_objective(load_config(overrides=["model.draft.variant=medusa"]))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_exports_a_config_its_spec_reads_back(name):
    cfg = load_config(overrides=[f"model.draft.variant={name}"])
    spec = draft_spec(cfg, build_target(cfg, CPU))
    conf = export_config(spec)
    assert conf["architectures"] == [VARIANTS[name].architecture]
    assert spec_from_export(conf) == spec and spec.family is VARIANTS[name]
    assert all(k in conf["dflash_config"] for k in VARIANTS[name].config_keys)


def test_step_settings_come_from_the_objective_and_the_spec():
    cfg = load_config()
    spec = draft_spec(cfg, build_target(cfg, CPU))
    s = step_settings(cfg, spec)
    assert (s.block_size, s.gamma, s.batch_mean, s.dpace_alpha, s.autocast_dtype) == (16, 7.0, False, None, None)
    d = step_settings(replace(cfg, objective=replace(cfg.objective, position_weights="dpace", loss_norm="batch",
                                                     dpace_alpha=0.3)), spec,
                      torch.bfloat16)
    assert (d.dpace_alpha, d.batch_mean, d.autocast_dtype) == (0.3, True, torch.bfloat16)
    with pytest.raises(ValueError, match="block_size"):
        step_settings(Config(objective=ObjectiveConfig(block_size=8)), spec)


def _random_dataset(gen: np.random.Generator, n: int) -> TokenDataset:
    lengths = gen.integers(0, 12, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask = gen.random(int(offsets[-1])) < 0.5
    return TokenDataset(np.zeros(int(offsets[-1]), dtype=np.int64), offsets, mask.astype(np.uint8), vocab_size=8)


def test_the_anchor_rule_is_counted_as_it_is_drawn():
    gen = np.random.default_rng(0)
    ds = _random_dataset(gen, 300)
    for i in range(len(ds)):
        _, mask = ds.sample(i)
        assert len(anchor_candidates(torch.as_tensor(np.asarray(mask)))) == ds.num_anchorable[i]
    mask = torch.as_tensor(np.asarray(ds.loss_mask))
    cu = torch.as_tensor(ds.offsets)
    anchors, anchor_cu = draw_anchors(mask, cu, 3, torch.Generator().manual_seed(1))
    assert (anchor_cu[1:] - anchor_cu[:-1]).tolist() == anchors_per_sample(ds.num_anchorable, 3).tolist()
    assert all(bool(mask[a + 1]) for a in anchors.tolist())  # each anchor's next token is supervised
    # A tail-supervised sample (a chat reply): the forecast's count without a mask is the same.
    lengths, sup = np.array([5, 5, 1, 0, 7]), np.array([2, 5, 1, 0, 0])
    first = (sup == lengths) & (lengths > 0)
    assert tail_anchorable(lengths, sup).tolist() == count_anchorable(sup, first).tolist() == [2, 4, 0, 0, 0]


def test_the_accepted_length_is_the_run_of_hits_plus_the_bonus_token():
    hits = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert accepted_lengths(hits).tolist() == [3.0, 1.0, 5.0]


def test_targets_declare_how_they_decode():
    from dflash_dist.models.decode import sequence_cache
    from dflash_dist.models.head import HeadOnlyTarget
    from dflash_dist.models.hf_target import HFTarget
    from dflash_dist.models.target import Target, TargetShapes
    tiny = build_target(load_config(), CPU)
    assert tiny.kind == "tiny" and isinstance(tiny, Target) and HFTarget.kind == "hf"
    facts = {k: getattr(tiny, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                            "head_dim", "intermediate_size", "rope_theta", "rms_eps",
                                            "max_position_embeddings")}
    head = HeadOnlyTarget(facts, tiny.embed_tokens, tiny.lm_head)
    assert head.kind == "head" and isinstance(head, TargetShapes) and not isinstance(head, Target)
    with pytest.raises(ValueError, match="does not decode"):
        sequence_cache(head, [0], 8)


def test_the_optimizer_step_skips_a_non_finite_step_and_stops_after_too_many():
    from dflash_dist.training.state import TrainState
    from dflash_dist.training.stats import Diverged
    cfg = load_config(overrides=["train.max_nonfinite_steps=2"])
    model = torch.nn.Linear(2, 2)
    st = TrainState.create(model, cfg, total_steps=10)
    before = model.weight.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    st.optimizer_step(list(model.parameters()), cfg, float("nan"))
    assert torch.equal(model.weight, before) and st.totals.skipped_steps == 1 and st.totals.last_finite_step == 0
    model.weight.grad = torch.ones_like(model.weight)
    st.optimizer_step(list(model.parameters()), cfg, 1.0)
    assert not torch.equal(model.weight, before) and st.totals.last_finite_step == 2
    model.weight.grad = torch.full_like(model.weight, math.inf)
    with pytest.raises(Diverged, match="max_nonfinite_steps=2"):
        st.optimizer_step(list(model.parameters()), cfg, 1.0)


def test_the_progress_line_names_the_training_estimate_and_the_measured_tau_apart():
    p = Progress(num_epochs=1, epoch_counts=[10], epoch_batches=10, started=time.time() - 5)
    p.accept_len = 4.21
    line = format_line(snapshot(p, CPU))
    assert "accept_len(train) 4.21" in line and "tau(held-out) -" in line
    p.tau = {"tau": 1.66, "step": 300}
    rec = snapshot(p, CPU)
    assert (rec["accept_len"], rec["tau"], rec["tau_step"]) == (4.21, 1.66, 300)
    assert "tau(held-out) 1.66 @step 300" in format_line(rec)
