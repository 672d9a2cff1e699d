"""The memory model: the reference config fits an H200, a small device is refused naming the key, and the
model matches what the real code allocates on CPU at a scaled shape."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest

from dflash_dist.bench import memory as BM
from dflash_dist.config import load_config
from dflash_dist.forecast import memory as M
from dflash_dist.forecast.shapes import TARGET_SHAPES, builtin_shape_name, model_shapes
from dflash_dist.plan.epochs import build_plan, plan_kwargs

REF = "configs/qwen3_8b.yaml"


@pytest.fixture(scope="module")
def reference():
    """(config, shapes, worst batches) of the reference job on the 902K chat mix, two epochs."""
    cfg = load_config(REF)
    lengths, supervised, anchorable, _ = M.plan_lengths(cfg)
    worst = M.worst_batches(cfg, lengths, supervised, anchorable, epochs=range(2))
    return cfg, model_shapes(cfg, "qwen3-8b"), list(worst.values())


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
    anchorable = M.tail_anchorable(lengths, supervised)
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

    from dflash_dist.training.objective import draw_anchors
    for length, sup in ((10, 3), (10, 10), (5, 2), (3, 3), (12, 0), (2, 1), (1, 1)):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length - sup:] = True
        anchors, _ = draw_anchors(mask, torch.tensor([0, length]), 1000, torch.Generator().manual_seed(0))
        assert M.tail_anchorable(np.array([length]), np.array([sup]))[0] == anchors.numel(), (length, sup)


def test_shapes_from_a_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 160,
        "rope_parameters": {"rope_theta": 1e6}, "tie_word_embeddings": True}))
    cfg = load_config(None, ["model.target.kind=hf", f"model.target.path={tmp_path}"])
    s = model_shapes(cfg)
    assert (s.vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.tied) == \
        (1000, 64, 6, 4, 2, 32, 160, True)
    assert s.draft_heads == 4 and len(s.feature_layers) == 3 and s.arch == "qwen3"
    pred = M.predict(cfg, s, M.BatchShape(tokens=1000, seqs=2, anchors=30), 2.0)  # 1 GiB is CUDA's own
    assert pred.unsure is None and pred.fits
    with pytest.raises(FileNotFoundError, match="target-shape"):
        model_shapes(load_config(None, ["model.target.kind=hf", f"model.target.path={tmp_path / 'none'}"]))


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


# -- large and MoE targets ------------------------------------------------------------------------------

@pytest.mark.parametrize("path,key,params", [
    # Parameter counts: the checkpoints' safetensors index total_size / 2 (bf16).
    ("configs/llama3_70b_tp2.yaml", "llama-3.3-70b", 70_553_706_496),
    ("configs/qwen3_moe.yaml", "qwen3-30b-a3b", 30_532_122_624),
])
def test_example_configs_resolve_to_built_in_shapes_and_fit(tmp_path, path, key, params):
    s = model_shapes(load_config(path))
    assert s.source.startswith(f"built-in shape {key} (named like") and s.target_params == params
    out = tmp_path / "mem.json"
    assert BM.main(["--config", path, "--gpu-mem-gib", "141", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["fits"] is True and data["unsure"] is None
    assert data["best_anchor_chunk"] >= data["anchor_chunk"] > 0
    tp = load_config(path).model.target.tensor_parallel
    assert data["roles"]["target"]["terms_gib"]["weights"] == pytest.approx(params * 2 / tp / M.GiB, rel=1e-3)


def test_built_in_shape_names():
    assert builtin_shape_name("/models/Llama-3.3-70B-Instruct") == "llama-3.3-70b"
    assert builtin_shape_name("/m/Qwen3-235B-A22B-Instruct-2507") == "qwen3-235b-a22b"
    assert builtin_shape_name("Qwen3-8B") == "qwen3-8b"
    assert builtin_shape_name("/m/Qwen3-8B-FP8") is None  # other bytes per weight: not the built-in shape
    s = TARGET_SHAPES["qwen3-235b-a22b"]
    assert model_shapes(load_config("configs/qwen3_moe.yaml"), "qwen3-235b-a22b").target_params == 235_093_634_560
    assert s["sparse_layers"] == tuple(range(94))


def test_moe_weight_bytes_are_the_models_parameters(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    hc = BM.tiny_moe_config(mlp_only_layers=[1], decoder_sparse_step=1)
    hc.to_json_file(str(tmp_path / "config.json"))
    model = AutoModelForCausalLM.from_config(hc).to(torch.bfloat16)
    cfg = load_config(None, ["model.target.kind=hf", f"model.target.path={tmp_path}", "model.target.dtype=bfloat16"])
    s = model_shapes(cfg)
    assert (s.arch, s.experts, s.experts_per_token, s.moe_intermediate, s.sparse_layers) == \
        ("qwen3_moe", 16, 4, 96, (0, 2, 3))
    total = sum(p.numel() for p in model.parameters())
    # What every rank of a tensor-parallel replica holds whole: norms and routers (transformers' TP plan).
    whole = sum(p.numel() for n, p in model.named_parameters() if "norm" in n or n.endswith("mlp.gate.weight"))
    assert s.target_param_split() == (total - whole, whole)
    p = M.Precision.from_config(cfg)
    batch = M.BatchShape(tokens=100, seqs=1, anchors=10)
    weights = {tp: M.target_terms(s, p, cfg, batch, M.Sharding(tensor_parallel=tp))["weights"] for tp in (1, 2, 4)}
    assert weights[1] == total * 2 == sum(t.numel() * t.element_size() for t in model.parameters())
    for tp in (2, 4):
        assert weights[tp] == ((total - whole) / tp + whole) * 2
    dense = replace(s, experts=0, sparse_layers=())  # the experts priced as one dense MLP: far too little
    assert M.target_terms(dense, p, cfg, batch)["weights"] < 0.6 * weights[1]


def _mixtral():
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, intermediate_size=64, num_local_experts=8,
                         num_experts_per_tok=2)


def _dense_qwen3():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=64, intermediate_size=384)


@pytest.mark.parametrize("name,config,layer_ids,bf16,labels", [
    ("qwen3-moe", lambda: BM.tiny_moe_config(), [1, 2], False, "data"),
    # Wide experts: the peak is at the gate (gate_up output, silu, product) ...
    ("gate-bound", lambda: BM.tiny_moe_config(moe_intermediate_size=256), [0, 2], True, "data"),
    # ... narrow ones: at the end (four (N*k, H) tensors side by side).
    ("end-bound", lambda: BM.tiny_moe_config(moe_intermediate_size=32), [0, 2], True, "data"),
    # A dense layer (mlp_only_layers) wider than the sparse ones sets the peak.
    ("mixed", lambda: BM.tiny_moe_config(mlp_only_layers=[2], intermediate_size=1024, moe_intermediate_size=32),
     [0, 2], False, "data"),
    ("distill", lambda: BM.tiny_moe_config(), [0, 1], True, "target_argmax"),
    ("mixtral", _mixtral, [0, 2], True, "data"),  # float32 routing weights: float32 weighted rows
    ("dense", _dense_qwen3, [0, 2], False, "data"),  # the layer's input held when it is not captured
])
def test_transformers_capture_matches_measurement(tmp_path, name, config, layer_ids, bf16, labels):
    v = BM.validate_hf_capture(config(), tmp_path, layer_ids, bf16=bf16, labels=labels)
    t = v["terms"]
    assert t["weights"] == v["weights"]
    capture = t["capture"] + t.get("distill", 0.0)
    assert 0.97 <= capture / v["capture"] <= 1.03, (name, capture, v["capture"])
    assert 0.97 <= sum(t.values()) / v["measured"] <= 1.03, (name, t, v["measured"])


@pytest.mark.parametrize("config,tp,heads", [
    (REF, 16, "32 attention heads and 8 key/value heads"),
    ("configs/llama3_70b_tp2.yaml", 3, "64 attention heads and 8 key/value heads")])
def test_a_tensor_parallel_split_train_refuses_is_exit_2_not_fits(config, tp, heads, capsys):
    """The forecast applies loading's own rule (models.hf_target.check_head_split), not a copy of it."""
    from types import SimpleNamespace

    from dflash_dist.models.hf_target import _check_shardable
    assert BM.main(["--config", config, f"model.target.tensor_parallel={tp}"]) == 2
    err = capsys.readouterr().err
    with pytest.raises(ValueError) as loading:
        n_heads, kv = (32, 8) if config == REF else (64, 8)
        _check_shardable(SimpleNamespace(num_attention_heads=n_heads, num_key_value_heads=kv), tp, False)
    assert err == f"error: {loading.value}\n" and heads in err


@pytest.mark.parametrize("value,says", [("nan", "must be a finite number > 0, got nan"),
                                        ("0", "must be a finite number > 0, got 0"),
                                        ("-141", "must be a finite number > 0, got -141")])
def test_gpu_mem_gib_out_of_range_is_refused(value, says, capsys):
    with pytest.raises(SystemExit) as e:
        BM.main(["--config", REF, f"--gpu-mem-gib={value}"])
    assert e.value.code == 2 and f"argument --gpu-mem-gib: {says}" in capsys.readouterr().err


def test_a_cpu_run_is_priced_in_float32_against_this_machines_memory(tmp_path, capsys):
    """A CPU run of a small model (SmolLM2-135M's shape): float32 weights (twice a CUDA run's bf16), the
    sdpa path, and the host's memory, not an H200's 141 GiB."""
    from helpers import smol_shape
    over = smol_shape(tmp_path)
    cpu_json = str(tmp_path / "c.json")
    assert BM.main(["--config", "configs/default.yaml", *over, "--device", "cpu", "--json", cpu_json]) == 0
    text = capsys.readouterr().out
    cpu = json.loads((tmp_path / "c.json").read_text())
    assert BM.main(["--config", "configs/default.yaml", *over, "--json", str(tmp_path / "g.json")]) == 0
    gpu = json.loads((tmp_path / "g.json").read_text())
    assert cpu["device_gib"] == pytest.approx(BM.host_memory_gib()) and gpu["device_gib"] == 141
    w_cpu, w_gpu = (d["roles"]["target"]["terms_gib"]["weights"] for d in (cpu, gpu))
    assert w_cpu == pytest.approx(2 * w_gpu) and w_cpu == pytest.approx(model_shapes(
        load_config("configs/default.yaml", over)).target_params * 4 / M.GiB, rel=1e-3)
    assert "precision: cpu: float32 target, drafter float32, sdpa attention" in text
    assert gpu["precision"] == "cuda: bf16 target, drafter bf16 autocast, flex attention"
    assert f"cpu device {BM.host_memory_gib():.3g} GiB: fits" in text


def test_json_is_checked_before_the_prediction(tmp_path, monkeypatch, capsys):
    from helpers import read_only
    monkeypatch.setattr(BM, "evaluate", lambda *a, **k: pytest.fail("predicted before --json was checked"))
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        assert BM.main(["--config", REF, "--json", str(tmp_path / "ro" / "m.json")]) == 2
    assert f"error: --json {tmp_path / 'ro' / 'm.json'}: cannot write in " in capsys.readouterr().err


def test_validate_says_what_it_checks_before_each_long_part(monkeypatch):
    """--validate's parts take minutes: each is announced (and flushed) before it starts, and says that it
    checks a built-in scaled shape, not the config's."""
    class Out:
        def __init__(self):
            self.text, self.flushed = "", ""

        def write(self, s):
            self.text += s

        def flush(self):
            self.flushed = self.text

    out, seen = Out(), []

    def fake_validate(sc, time_steps=True, reps=3):
        seen.append(out.flushed.splitlines()[-1])
        return {"shape": sc.__dict__, "batch": {}, "target": {"predicted": 1, "measured": 1},
                "chunked": {"predicted": 1, "measured": 1, "saved_predicted": 1, "saved_measured": 1},
                "unchunked": {"predicted": 1, "measured": 1, "saved_predicted": 1, "saved_measured": 1}}

    def fake_hf(*a, **k):
        seen.append(out.flushed.splitlines()[-1])
        return {"terms": {"capture": 1, "weights": 1}, "capture": 1, "weights": 1}
    monkeypatch.setattr(BM, "validate", fake_validate)
    monkeypatch.setattr(BM, "validate_hf_capture", fake_hf)
    BM.run_validation(out)
    assert seen == ["validating at a built-in scaled shape, not the config's (float32, hidden 256, 4 x 600 tokens)...",
                    "validating at a built-in scaled shape, not the config's (bf16, hidden 256, 4 x 600 tokens)...",
                    "validating a tiny transformers Qwen3-MoE target's capture..."]


def test_validate_checks_the_configs_own_target_where_it_can_be_built(tmp_path, capsys):
    """--validate's last part is the given config's target (a transformers model of its config.json, random
    weights): its capture measured against the prediction. Where it cannot be built, a line says why."""
    import io

    from helpers import SMOL
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(SMOL | {"num_hidden_layers": 4, "vocab_size": 4096}))
    cfg = load_config("configs/default.yaml", ["model.target.kind=hf", f"model.target.path={tmp_path / 'm'}",
                                               "model.draft.target_layer_ids=[0,2]"])
    out = io.StringIO()
    v = BM.validate_config_target(cfg, model_shapes(cfg), out)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"validating the config's own target ({tmp_path / 'm'}, random weights, float32)..."
    assert lines[1].startswith("the config's target: capture predicted ")
    assert 0.97 <= v["capture_predicted"] / v["capture_measured"] <= 1.03, v
    assert 0.97 <= v["peak_predicted"] / v["peak_measured"] <= 1.03, v
    tiny = "it is the tiny target (the scaled shapes above are of its kind)"
    for c, why in ((load_config("configs/default.yaml"), tiny),
                   (load_config(REF), "/models/Qwen3-8B/config.json is not here")):
        out = io.StringIO()
        assert BM.validate_config_target(c, model_shapes(c, "qwen3-8b" if c.model.target.kind == "hf" else None),
                                         out) is None
        assert out.getvalue() == f"the config's own target is not validated: {why}\n"


def test_colocated_ranks_with_a_split_target_are_refused_as_train_refuses_them(capsys):
    assert BM.main(["--config", "configs/default.yaml", "roles.mode=colocated", "model.target.tensor_parallel=2"]) == 2
    assert ("config keys 'roles.mode' and 'model.target.tensor_parallel': colocated ranks each hold a whole target"
            in capsys.readouterr().err)


def test_the_dflash_drafter_adds_nothing_to_the_forecasts():
    """The default variant's forecast terms are the interface's own answers: nothing beyond what the memory
    and cost models count of the DFlash drafter."""
    from dflash_dist.forecast.variants import ChunkBytes, forecast_of
    from dflash_dist.models.variants.forecast import VariantForecast
    cfg = load_config()
    s, own = model_shapes(cfg), forecast_of(cfg)
    assert type(own) is VariantForecast and own.params(s, cfg) == 0 and own.cost_terms(s, cfg, 4, 64, 60.0, 4) == {}
    assert own.chunk_bytes(s, M.Precision(device="cpu"), cfg, 64, 64, 4) == ChunkBytes(0, 0, 0)
    assert own.layer_row_bytes(s, M.Precision(device="cpu"), cfg) == 0 and own.distill_passes(cfg) == 1.0


def test_each_variant_owns_its_forecast_terms_and_the_variant_registry_is_the_only_list():
    """Issue 45: a variant is one folder, its forecast terms included. Every registered variant declares a
    `VariantForecast` (its own subclass in its own folder, or the default), the forecasts ask exactly that
    object, and forecast/variants.py holds no variant's class nor a table of them (a second registry)."""
    from dflash_dist.forecast import variants as FV
    from dflash_dist.models.variants import VARIANTS
    from dflash_dist.models.variants.forecast import VariantForecast
    for name, variant in VARIANTS.items():
        own = variant.forecast
        assert isinstance(own, VariantForecast), name
        assert type(own) is VariantForecast or type(own).__module__.startswith(type(variant).__module__), name
        assert FV.forecast_of(load_config(overrides=[f"model.draft.variant={name}"])) is own
    assert {n for n in VARIANTS if type(VARIANTS[n].forecast) is not VariantForecast} >= {"dflash2", "dspark", "domino"}
    for key, value in vars(FV).items():
        if isinstance(value, type) and issubclass(value, VariantForecast) or key.endswith("Forecast"):
            assert value is VariantForecast, f"forecast/variants.py defines {key}: it belongs in its variant's folder"
        assert not (isinstance(value, dict) and any(isinstance(v, VariantForecast) for v in value.values())), key


def test_a_variant_without_forecast_terms_is_refused_naming_the_key(monkeypatch):
    """A variant registered from outside that declares `forecast = None` (the old way of saying "the built-in
    table's") has no terms to ask: a ConfigError naming the key, not an AttributeError mid-forecast."""
    from dflash_dist.config import ConfigError
    from dflash_dist.forecast.variants import forecast_of
    from dflash_dist.models.variants import VARIANTS, Variant

    class Bare(Variant):
        name = "bare"
        forecast = None

    monkeypatch.setitem(VARIANTS, "bare", Bare())
    cfg = load_config(overrides=["model.draft.variant=bare"])
    with pytest.raises(ConfigError, match="'model.draft.variant': variant 'bare' declares no forecast terms"):
        forecast_of(cfg)
