"""The memory model: the reference config fits an H200, a small device is refused naming the key, and the
model matches what the real code allocates on CPU at a scaled shape."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest

from dflash_dist import memory as M
from dflash_dist.bench import memory as BM
from dflash_dist.config import load_config
from dflash_dist.plan import build_plan, plan_kwargs

REF = "configs/qwen3_8b.yaml"


@pytest.fixture(scope="module")
def reference():
    """(config, shapes, worst batches) of the reference job on the 902K chat mix, two epochs."""
    cfg = load_config(REF)
    lengths, supervised, anchorable, _ = M.plan_lengths(cfg)
    worst = M.worst_batches(cfg, lengths, supervised, anchorable, epochs=range(2))
    return cfg, M.model_shapes(cfg, "qwen3-8b"), list(worst.values())


def test_cli_json_for_the_reference_config(tmp_path, capsys):
    out = tmp_path / "mem.json"
    # The command: model.target.path (/models/Qwen3-8B) is absent here, so the built-in shape
    # named like it is used, and said so.
    assert BM.main(["--config", REF, "--gpu-mem-gib", "141", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["target_shape"].startswith("built-in shape qwen3-8b")
    assert data["device_gib"] == 141 and data["fits"] is True
    assert 0 < data["roles"]["drafter"]["peak_gib"] <= 100  # the targets
    assert 0 < data["roles"]["target"]["peak_gib"] <= 60
    assert data["anchor_chunk"] == load_config(REF).objective.anchor_chunk > 0
    assert data["best_anchor_chunk"] >= data["anchor_chunk"]
    assert data["worst_batches"]["anchors"]["anchors"] > 20_000  # the long tail of the chat mix
    table = capsys.readouterr().out
    assert "drafter" in table and "target" in table and "activations" in table


def test_too_small_device_is_refused_naming_the_key(reference):
    cfg, shapes, worst = copy.deepcopy(reference)
    pred = M.predict(cfg, shapes, worst, device_gib=50.0)
    assert not pred.fits and pred.fits_role("target")
    assert M.preflight_message(pred, "target") is None
    msg = M.preflight_message(pred, "drafter")
    assert "drafter" in msg and "50.0 GiB" in msg and f"{pred.roles['drafter'].peak_gib:.1f} GiB" in msg
    best = pred.best_anchor_chunk
    assert 0 < best < cfg.objective.anchor_chunk and f"objective.anchor_chunk={best}" in msg
    assert "model.draft.checkpoint_layers" in msg and "plan.token_budget" in msg
    # The proposed chunk is the largest that fits.
    for chunk, fits in ((best, True), (best + 1, False)):
        cfg.objective.anchor_chunk = chunk
        assert M.predict(cfg, shapes, worst, device_gib=50.0).fits_role("drafter") == fits
    pred = M.predict(cfg, shapes, worst, device_gib=20.0)
    msg = M.preflight_message(pred, "target")
    assert "target role" in msg and "plan.token_budget" in msg


def test_memory_follows_the_chunk_and_checkpointing(reference):
    cfg, shapes, worst = copy.deepcopy(reference)
    peaks = []
    for chunk in (256, 1024, 4096, 0):
        cfg.objective.anchor_chunk = chunk
        peaks.append(M.predict(cfg, shapes, worst, 141.0).roles["drafter"].peak_gib)
    assert peaks == sorted(peaks) and peaks[-1] > 141  # the unchunked step would not fit
    cfg.objective.anchor_chunk = 4096
    cfg.model.draft.checkpoint_layers = True
    assert M.predict(cfg, shapes, worst, 141.0).roles["drafter"].peak_gib < peaks[2]


def test_worst_batches_are_those_of_the_plan():
    cfg = load_config(None, ["plan.token_budget=4000", "objective.num_anchors=100", "train.epochs=2"])
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 3000, 500)
    supervised = (lengths * rng.uniform(0.2, 0.9, 500)).astype(np.int64)
    anchorable = M.tail_anchorable(lengths, supervised, cfg.objective.block_size)
    worst = M.worst_batches(cfg, lengths, supervised)
    best = {"anchors": 0, "tokens": 0}
    for epoch in range(2):
        plan = build_plan(lengths, supervised, epoch=epoch, anchorable=anchorable, **plan_kwargs(cfg))
        for b in range(len(plan)):
            idx = plan.batch(b)
            best["anchors"] = max(best["anchors"], int(np.minimum(anchorable[idx], 100).sum()))
            best["tokens"] = max(best["tokens"], int(lengths[idx].sum()))
    assert worst["anchors"].anchors == best["anchors"] and worst["tokens"].tokens == best["tokens"]


def test_tail_anchorable_counts_what_draw_anchors_draws_from():
    import torch
    from dflash_dist.objective import draw_anchors
    B = 4
    for length, sup in ((10, 3), (10, 10), (5, 2), (3, 3), (12, 0)):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length - sup:] = True
        anchors, _ = draw_anchors(mask, torch.tensor([0, length]), B, 1000, torch.Generator().manual_seed(0))
        assert M.tail_anchorable(np.array([length]), np.array([sup]), B)[0] == anchors.numel(), (length, sup)


def test_shapes_from_a_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 160,
        "rope_parameters": {"rope_theta": 1e6}, "tie_word_embeddings": True}))
    cfg = load_config(None, ["model.target.kind=hf", f"model.target.path={tmp_path}"])
    s = M.model_shapes(cfg)
    assert (s.vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.tied) == \
        (1000, 64, 6, 4, 2, 32, 160, True)
    assert s.draft_heads == 4 and len(s.feature_layers) == 3 and s.arch == "qwen3"
    pred = M.predict(cfg, s, M.BatchShape(tokens=1000, seqs=2, anchors=30), 2.0)  # 1 GiB is CUDA's own
    assert pred.unsure is None and pred.fits
    with pytest.raises(FileNotFoundError, match="target-shape"):
        M.model_shapes(load_config(None, ["model.target.kind=hf", f"model.target.path={tmp_path / 'none'}"]))


SMALL = BM.Scaled(hidden=128, vocab=4096, intermediate=384, head_dim=32, seqs=2, seq_len=600, num_anchors=256,
                  anchor_chunk=64, loss_rows=512)


@pytest.mark.parametrize("bf16,labels", [(False, "data"), (True, "data"), (True, "target_soft"),
                                         (False, "target_argmax")])
def test_prediction_matches_measurement_at_a_scaled_shape(bf16, labels):
    v = BM.validate(replace(SMALL, bf16=bf16, labels=labels), time_steps=False)
    assert v["batch"]["anchors"] == 512
    ratios = {"target": v["target"]["predicted"] / v["target"]["measured"]}
    for name in ("chunked", "unchunked"):
        ratios[name] = v[name]["predicted"] / v[name]["measured"]
        ratios[name + " saved"] = v[name]["saved_predicted"] / v[name]["saved_measured"]
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios
    assert v["unchunked"]["measured"] > 4 * v["chunked"]["measured"]  # the chunk bounds the step


@pytest.mark.parametrize("bf16", [False, True])
def test_checkpointed_layers_peak_matches_measurement(bf16):
    """Three layers so that the kept inputs count; saved bytes are not measurable under checkpointing."""
    sc = replace(SMALL, bf16=bf16, checkpoint_layers=True, draft_layers=3)
    v = BM.validate(sc, time_steps=False)
    ratios = [v[name]["predicted"] / v[name]["measured"] for name in ("target", "chunked", "unchunked")]
    assert all(0.85 <= r <= 1.15 for r in ratios), ratios
    assert v["chunked"]["saved_measured"] is None
