"""The contract every registered drafter variant keeps (parametrised over `models.variants.VARIANTS`, so a
variant added later is held to it without an edit here): the forecast counts the built module's
parameters exactly; anchor and row chunking change memory, not the loss, the gradients or the metrics
(the variant's declared sums included);
an export loads back (models/export.py, evaluation/loading.py) to the same spec and weights.

Each variant's own unit file keeps what only it has: its loss against its plain reference (tests/support/
oracles.py and the references written there), its contract fields, its decoder."""
from __future__ import annotations

import json

import helpers
import pytest
import torch
from drafter_batches import three_sequences
from variant_models import CONFIG_OPTIONS, NAMES, feat_dim, make_model, tiny_spec

from dflash_dist.config import load_config
from dflash_dist.evaluation.loading import load_drafter_checked, read_export_config
from dflash_dist.forecast import variants as FV
from dflash_dist.forecast.shapes import model_shapes
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.export import export_drafter
from dflash_dist.models.variants import RunProgress, variant_of_export
from dflash_dist.training.step import StepBatch, drafter_step, step_settings

CPU = torch.device("cpu")
# A few shapes of the backbone: layers, block size (and with them the variant's per-layer modules).
SHAPES = [["model.draft.num_layers=1"], ["model.draft.num_layers=3", "objective.block_size=8"]]


@pytest.mark.parametrize("shape", SHAPES, ids=["1-layer", "3-layer-B8"])
@pytest.mark.parametrize("name", NAMES)
def test_the_forecast_counts_the_built_drafters_parameters(name, shape):
    cfg = load_config(overrides=[f"model.draft.variant={name}", *CONFIG_OPTIONS.get(name, []), *shape])
    target = build_target(cfg, CPU)
    drafter = build_drafter(draft_spec(cfg, target), target, 0, CPU)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in drafter.parameters())  # the target's head is not the drafter's
    assert FV.draft_param_count(model_shapes(cfg), cfg) == trainable


def step(model, batch, **objective):
    """The step's gradients and metrics at a run's step 3 of 10 (a schedule, Domino's lambda, strictly
    between its ends, so that every head gets a gradient)."""
    data, feats, anchors, anchor_cu = batch
    model.zero_grad(set_to_none=True)
    cfg = helpers.config_of(block_size=model.spec.block_size, gamma=4.0, **objective)
    m = drafter_step(model, StepBatch(data, feats, None, anchors, anchor_cu, RunProgress(3, 10)),
                     step_settings(cfg, model.spec))
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, m


@pytest.mark.parametrize("anchor_chunk, loss_rows", [(4, 3), (1, 5), (0, 7)])
@pytest.mark.parametrize("name", NAMES)
def test_the_chunked_step_equals_the_unchunked_step(name, anchor_chunk, loss_rows):
    spec = tiny_spec(name)
    batch = three_sequences(spec.vocab_size, feat_dim(spec))
    # Chunks of 4 (and 1) cut through a sequence's anchors: sequence 0 holds 6 of them.
    assert int(batch[3][1]) == 6
    model = make_model(spec)
    want, wm = step(model, batch)
    got, gm = step(model, batch, anchor_chunk=anchor_chunk, loss_rows=loss_rows)
    assert got.keys() == want.keys() == {k for k, _ in model.named_parameters()}
    for k in want:
        # the tolerance of the variants' plain-reference tests: the chunked sums add in another order
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=4e-6 * float(want[k].abs().max()), msg=k)
    assert float(gm.loss_sum) == pytest.approx(float(wm.loss_sum), rel=1e-5)
    assert float(gm.weight_sum) == pytest.approx(float(wm.weight_sum), rel=1e-6)
    assert torch.equal(gm.correct, wm.correct) and torch.equal(gm.valid, wm.valid)
    assert gm.num_blocks == wm.num_blocks and float(gm.accept_sum) == pytest.approx(float(wm.accept_sum))
    # the loss term returns exactly the sums its variant declares (`Variant.figures`), the same chunked or not
    assert gm.sums.keys() == wm.sums.keys() == set(spec.family.figures.names)
    for k in spec.family.figures.slots:
        assert torch.equal(gm.sums[k], wm.sums[k]), k
    for k in spec.family.figures.scalars:
        assert float(gm.sums[k]) == pytest.approx(float(wm.sums[k]), rel=1e-5), k


@pytest.mark.parametrize("name", NAMES)
def test_an_export_loads_back_to_the_same_spec_and_weights(name, tmp_path):
    spec = tiny_spec(name)
    state = make_model(spec).state_dict()
    exact = export_drafter(spec, state, tmp_path / "f32", dtype=torch.float32)
    conf = read_export_config(exact)
    assert variant_of_export(conf).name == name
    back = load_drafter_checked(exact)
    assert back.spec == spec and back.state_dict().keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(back.state_dict()[k], v), k
    # the default export (bfloat16) rounds each tensor once, but those the engine holds in float32
    half = export_drafter(spec, state, tmp_path / "bf16")
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_drafter_checked(half)
    assert back.spec == spec
    for k, v in state.items():
        keep = k.startswith(spec.family.float32_prefixes)
        assert torch.equal(back.state_dict()[k], v if keep else v.to(torch.bfloat16).float()), k
