"""The cost model (dflash_dist.forecast.cost): its FLOP counts against torch's own count of the real code, the split
it picks, the start-of-run lines, the bench command, and its drafter:target time ratio against the real
code's on CPU."""
from __future__ import annotations

import json
import logging
import re

import helpers
import numpy as np
import pytest
import torch
from helpers import smol_shape
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dflash_dist.bench import cost as bench_cost
from dflash_dist.bench.cost import scaled_job
from dflash_dist.bench.memory import Scaled
from dflash_dist.config import load_config, loss_gamma
from dflash_dist.forecast import cost as C
from dflash_dist.forecast.memory import BatchShape, Precision, Sharding
from dflash_dist.forecast.shapes import model_shapes
from dflash_dist.models import attention as attn
from dflash_dist.models.build import build_drafter, draft_spec
from dflash_dist.training.capture import capture_for_drafter

TINY = Scaled(hidden=64, vocab=512, intermediate=192, target_layers=4, heads=4, kv_heads=2, head_dim=16,
              draft_layers=2, seqs=3, seq_len=70, prompt=10, num_anchors=12, anchor_chunk=16, loss_rows=64)
F32 = Precision(device="cpu", target_bytes=4, transfer_bytes=4, drafter_compute=4, attention="sdpa")


def counted(fn) -> dict[str, float]:
    """FLOPs torch counts while `fn` runs, as {"mm": dense products, "bmm": batched ones}: with SDPA's math
    kernel, attention decomposes into batched products, which the counter sees."""
    with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as fc:
        fn()
    ops = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    return {"mm": sum(v for k, v in ops.items() if k.endswith(("aten.mm", "aten.addmm"))),
            "bmm": sum(v for k, v in ops.items() if k.endswith(("aten.bmm", "aten.baddbmm")))}


def tiny_setup(sc: Scaled = TINY, **cfg_overrides):
    """The bench's own scaled job on the CPU, in float32."""
    return scaled_job(sc, torch.device("cpu"), tuple(f"{k}={v}" for k, v in cfg_overrides.items()))


def within(a: float, b: float, tol: float = 0.05) -> bool:
    return abs(a / b - 1) <= tol


def test_target_flops_match_torch_count():
    cfg, target, batch, *_, shape = tiny_setup()
    ids = list(draft_spec(cfg, target).target_layer_ids)
    got = counted(lambda: capture_for_drafter(target, batch, ids, cfg.objective, torch.float32))
    t = C.target_terms(model_shapes(cfg), F32, cfg, shape).terms
    assert within(t["layers"].amount, got["mm"]), (t["layers"].amount, got["mm"])
    # The math kernel scores every (query, key) pair and masks the causal half; the model counts the half.
    lens = np.asarray(shape.seq_lens, dtype=np.float64)
    dense = t["attention"].amount * (lens ** 2).sum() / (lens * (lens + 1) / 2).sum()
    assert within(dense, got["bmm"]), (dense, got["bmm"])


@pytest.mark.parametrize("path,checkpoint", [("ref", False), ("sdpa", False), ("sdpa", True)])
def test_drafter_flops_match_torch_count(path, checkpoint):
    cfg, target, batch, anchors, anchor_cu, shape = tiny_setup(**{"model.draft.checkpoint_layers": checkpoint})
    spec = draft_spec(cfg, target)
    model = build_drafter(spec, target, 0, torch.device("cpu"), checkpoint)
    feats, _ = capture_for_drafter(target, batch, list(spec.target_layer_ids), cfg.objective, torch.float32)

    def step():
        helpers.train_step(model, batch, feats, None, anchors, anchor_cu, gamma=loss_gamma(cfg.objective),
                     anchor_chunk=TINY.anchor_chunk, loss_rows=TINY.loss_rows)

    attn.backend.use(path)
    try:
        got = counted(step)
    finally:
        attn.backend.use(None)
    assert shape.anchors > 2 * TINY.anchor_chunk  # several chunks: their context spans are counted
    t = C.drafter_terms(model_shapes(cfg), Precision(device="cpu", target_bytes=4, transfer_bytes=4,
                                                     drafter_compute=4, attention=path),
                        cfg, shape, TINY.anchor_chunk, Sharding(drafters=1)).terms
    mm = sum(t[k].amount for k in ("fc", "context_kv", "layers", "lm_head", "recompute") if k in t)
    assert within(mm, got["mm"]), {k: v.amount for k, v in t.items()} | got
    blk = t["attention"].amount + (t["recompute_attention"].amount if checkpoint else 0)
    assert within(blk, got["bmm"]), (blk, got["bmm"])
    assert ("recompute" in t) == checkpoint


def test_block_pairs_by_path():
    """One sequence, anchors at 10, 20, 30, B = 4: flex counts each block's own context and block; ref one
    run with the last anchor's context; sdpa (runs of 32) the same context and every block of the run."""
    w = BatchShape(tokens=40, seqs=1, anchors=3, seq_lens=(40,), seq_anchors=(3,), anchor_pos=(10, 20, 30))
    assert C.block_pairs(w, 0, 4, "flex") == 4 * ((10 + 4) + (20 + 4) + (30 + 4))
    assert C.block_pairs(w, 0, 4, "ref") == 3 * 4 * (30 + 4)
    assert C.block_pairs(w, 0, 4, "sdpa") == 3 * 4 * (30 + 12)
    # chunks of 2 anchors: runs [10, 20] and [30]
    assert C.block_pairs(w, 2, 4, "sdpa") == 2 * 4 * (20 + 8) + 4 * (30 + 4)
    assert list(C.chunk_spans(w, 2)) == [20, 30]


def test_lockstep_is_the_expected_slowest():
    assert C.lockstep_seconds([1.0, 3.0], 1) == pytest.approx(2.0)
    assert C.lockstep_seconds([2.0] * 5, 7) == pytest.approx(2.0)
    # max of two draws from {1, 3}: 3 unless both are 1 (probability 1/4)
    assert C.lockstep_seconds([1.0, 3.0], 2) == pytest.approx(2.5, abs=0.05)


def _forecast(overrides=(), gpus=8, **kw):
    cfg = load_config("configs/qwen3_8b.yaml", list(overrides))
    ps = C.plan_sample_for(cfg, samples=20_000)
    return C.forecast(cfg, model_shapes(cfg, "qwen3-8b"), ps, C.DEVICES["h200"], gpus_per_node=gpus, **kw)


def test_split_is_the_fastest_candidate_and_follows_the_costs():
    fc = _forecast(["roles.drafters_per_node=2"])
    rates = {x["drafters_per_node"]: x["batches_per_s"] for x in fc.splits}
    assert list(rates) == list(range(1, 8))
    assert fc.best["batches_per_s"] == max(rates.values())
    for x in fc.splits:  # the rate is the slower role's
        replicas, d = x["target_replicas_per_node"], x["drafters_per_node"]
        assert x["batches_per_s"] == pytest.approx(min(replicas / x["target_s"], d / x["drafter_step_s"]))
    # Qwen3-8B: a drafter step costs more than a target forward, so more drafters than targets
    assert fc.per_batch["drafter"]["tflop"] > fc.per_batch["target"]["tflop"]
    assert fc.best["drafters_per_node"] > 4
    # a target 40x slower at attention: the balance tips towards targets
    slow_target = _forecast(["roles.drafters_per_node=2"], eff=C.Efficiency(causal_attention=0.01))
    assert slow_target.per_batch["target"]["avg_s"] > 2 * fc.per_batch["target"]["avg_s"]
    assert slow_target.best["drafters_per_node"] < fc.best["drafters_per_node"]


def test_tensor_parallel_splits_keep_whole_replicas():
    assert C.candidate_splits(8, 2) == [2, 4, 6]
    assert C.candidate_splits(8, 4) == [4]
    fc = _forecast(["model.target.tensor_parallel=2", "roles.drafters_per_node=2"])
    assert [x["drafters_per_node"] for x in fc.splits] == [2, 4, 6]
    assert all(x["target_replicas_per_node"] == (8 - x["drafters_per_node"]) // 2 for x in fc.splits)


def test_start_of_run_warning(caplog):
    fc = _forecast(["roles.drafters_per_node=1"])
    assert fc.slowdown > C.SLOW_WARN
    with caplog.at_level(logging.INFO, logger="dflash_dist.forecast.cost"):
        C.log_start(fc)
    rec = caplog.records[-1]
    assert rec.levelno == logging.WARNING
    assert f"set roles.drafters_per_node={fc.best['drafters_per_node']}" in rec.getMessage()
    best = _forecast([f"roles.drafters_per_node={fc.best['drafters_per_node']}"])
    warn, line = C.start_message(best)
    assert not warn and "predicted" not in line.split("; configured")[-1]
    assert best.slowdown == pytest.approx(1.0)


def test_predict_run_on_a_dataset(tmp_path):
    """A run's own forecast: its dataset's plan, its layout (a 4-rank node, 1 drafter)."""
    from dflash_dist.data.synthetic import synthetic_dataset
    from dflash_dist.parallel.topology import Layout
    cfg = load_config(None, ["data.synthetic.num_samples=60", "roles.drafters_per_node=1"])
    ds = synthetic_dataset(cfg.data.synthetic, cfg.model.target.vocab_size)
    fc = C.predict_run(cfg, ds, Layout(4, 4, 1), "cpu", batches=123)
    assert fc.ps.batches == 123 and fc.gpus_per_node == 4 and fc.configured == 1
    assert [x["drafters_per_node"] for x in fc.splits] == [1, 2, 3]
    per = C.predicted_per_batch(fc)
    assert per["target_s_per_batch"] > 0 and per["drafter_s_per_batch"] > 0


def test_bench_cost_writes_the_fields(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert bench_cost.main(["--config", "configs/qwen3_8b.yaml", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert set(d["per_batch_tflop"]) == {"target", "drafter"}
    assert d["per_batch_tflop"]["target"] == pytest.approx(2 * 7.5e9 * 49_152 / 1e12, rel=0.15)  # the count
    assert d["split"]["drafters_per_node"] in range(1, 8)
    assert {"samples_per_s", "mfu", "run_hours"} <= set(d["predicted"])
    assert 0 < d["predicted"]["mfu"] < 1
    assert "batches/s" in capsys.readouterr().out
    assert bench_cost.main(["--config", "configs/qwen3_8b.yaml", "--gpus-per-node", "1"]) == 2


def test_validate_ratio_on_cpu():
    """Predicted / measured drafter:target time ratio within 0.7-1.4 at a target-heavy and a drafter-heavy
    scaled shape (CPU seconds, min of alternating repetitions, the CPU's rates probed in between)."""
    v = bench_cost.validate(reps=3)
    assert v["target-heavy"]["measured"]["ratio"] < 1 < v["drafter-heavy"]["measured"]["ratio"]
    for name, r in v.items():
        q = r["predicted"]["ratio"] / r["measured"]["ratio"]
        assert 0.7 <= q <= 1.4, (name, r)


def test_balance_advice_prints_predicted_beside_measured():
    from dflash_dist.observe.balance import balance_advice, format_advice
    pred = {"target_s_per_batch": 0.012, "drafter_s_per_batch": 0.05, "drafter_step_s": 0.06,
            "best_drafters_per_node": 6, "device": "H200"}
    a = balance_advice(1.0, 7.0, 100, 8, 1, 0.8, 0.01, predicted=pred)
    assert a["predicted"] == pred and a["drafter_s_per_batch"] == pytest.approx(0.07)
    line = format_advice(a)
    assert "measured: target 10.0 ms, drafter 70.0 ms; predicted: target 12.0 ms, drafter 50.0 ms (H200" in line
    assert balance_advice(0, 1, 10, 4, 1, 0, 0, predicted=pred) == {"predicted": pred}
    assert "cost model: target 12.0 ms" in format_advice({"predicted": pred})


def test_gpu_check_grads_section_fails_loudly_on_a_wrong_path(monkeypatch):
    """The dry form of gpu_check's grads section passes as the code is, and fails, naming the path, when
    the sdpa path's output is off by 1%."""
    from dflash_dist.bench import gpu_grads
    from dflash_dist.bench.sections import Report
    rep = Report()
    gpu_grads.section_grads(rep, dry=True, deadline=0)
    rows = {m: (v, n) for m, v, n in rep.rows}
    assert rows["drafter float32 sdpa grads"][0] < gpu_grads.TOL["float32"]
    assert rows["target float32 flex features (eager)"][0] < gpu_grads.TOL["float32"]
    real = attn._sdpa_block
    monkeypatch.setattr(attn, "_sdpa_block", lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.raises(AssertionError, match="drafter float32 sdpa"):
        gpu_grads.section_grads(Report(), dry=True, deadline=0)


def test_gpu_check_cost_section_fails_outside_the_ratio_range(monkeypatch):
    from dflash_dist.bench.sections import Report

    def fake(overrides, reps, device):
        assert device == "cpu"
        return {"shape": {}, "batch": {"tokens": 1, "anchors": 1}, "device": {"tflops": 1.0, "mem_gbs": 1.0,
                "causal_attention": 1.0, "block_attention": 1.0},
                "predicted": {"target_s": 1.0, "drafter_s": 2.0, "ratio": 2.0},
                "measured": {"target_s": 1.0, "drafter_s": 1.0, "ratio": 1.0}}

    monkeypatch.setattr(bench_cost, "validate_shape", fake)
    rep = Report()
    with pytest.raises(AssertionError, match="target-heavy 2.00"):
        bench_cost.section_cost(rep, dry=True, deadline=float("inf"))
    assert [v for m, v, _ in rep.rows if m.endswith("ratio pred/meas")] == [2.0, 2.0]


def test_one_rank_per_node_has_no_split_but_a_forecast():
    """A colocated single-process run: the per-batch forecast, no split, no warning."""
    from dflash_dist.data.synthetic import synthetic_dataset
    from dflash_dist.parallel.topology import Layout
    cfg = load_config(None, ["data.synthetic.num_samples=40", "roles.mode=colocated"])
    ds = synthetic_dataset(cfg.data.synthetic, cfg.model.target.vocab_size)
    fc = C.predict_run(cfg, ds, Layout(1, 1, 1, colocated=True), "cpu", batches=10)
    assert fc.splits == [] and fc.configured is None
    warn, line = C.start_message(fc)
    assert not warn and "per batch target" in line and "best" not in line
    assert "best_drafters_per_node" not in C.predicted_per_batch(fc)


@pytest.mark.parametrize("flag,value,says", [
    ("--nodes", "0", "must be a finite number >= 1, got 0"), ("--nodes", "-2", "must be a finite number >= 1, got -2"),
    ("--gpus-per-node", "2.5", "'2.5' is not a whole number"), ("--tflops", "0", "must be a finite number > 0, got 0"),
    ("--tflops", "nan", "must be a finite number > 0, got nan"),
    ("--mem-gbs", "inf", "must be a finite number > 0, got inf"),
    ("--eff-matmul", "0", "must be a finite number in (0, 1], got 0"),
    ("--eff-memory", "-1", "must be a finite number in (0, 1], got -1"),
    ("--eff-network", "1.5", "must be a finite number in (0, 1], got 1.5"),
])
def test_bench_cost_refuses_a_numeric_flag_out_of_its_range(flag, value, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench_cost.parse(["--config", "configs/default.yaml", f"{flag}={value}"])
    assert e.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


def test_bench_cost_of_a_small_model_on_this_cpu(tmp_path, capsys):
    """SmolLM2-135M's forecast on the machine at hand: TFLOP per batch are not printed as 0, the device's
    rates are measured here (float32), the configured split that is the best reads so."""
    out = tmp_path / "cost.json"
    assert bench_cost.main(["--config", "configs/default.yaml", *smol_shape(tmp_path), "--device", "cpu",
                            "--gpus-per-node", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["device"] == "CPU (measured)" and 0 < d["per_batch_tflop"]["target"] < 1
    target_row = re.search(r"^ +target +(\S+) ", text, re.M)  # the role table's row
    assert float(target_row[1]) == pytest.approx(d["per_batch_tflop"]["target"], rel=5e-3)  # 3 digits, not "0"
    assert "device CPU (measured):" in text and "1 x 3 CPU processes" in text
    assert d["configured"]["drafters_per_node"] == d["split"]["drafters_per_node"] == 1
    assert "the configured split is the best" in text and "slower than the best" not in text


def test_measured_cpu_rates_are_the_probes_at_the_models_widths(tmp_path, monkeypatch):
    seen = {}
    real = bench_cost.rate_probes

    def probes(sc, rows, dev):
        seen.update(hidden=sc.hidden, intermediate=sc.intermediate, heads=sc.heads, bf16=sc.bf16)
        return real(sc, rows, dev)
    monkeypatch.setattr(bench_cost, "rate_probes", probes)
    cfg = load_config("configs/default.yaml", smol_shape(tmp_path))
    dev, eff = bench_cost.measure_cpu(model_shapes(cfg), ranks=2)
    assert seen == {"hidden": 576, "intermediate": 1536, "heads": 9, "bf16": False}
    assert dev.name == "CPU (measured)" and 0 < dev.tflops < 50 and dev.mem_gbs > 0
    assert eff.matmul == 1.0 and 0 < eff.causal_attention and 0 < eff.block_attention


def test_bench_cost_says_when_the_configured_split_cannot_exist(capsys):
    assert bench_cost.main(["--config", "configs/qwen3_8b.yaml", "--gpus-per-node", "2",
                            "roles.drafters_per_node=2"]) == 0
    text = capsys.readouterr().out
    assert ("the configured split cannot exist on 2 GPUs per node: config key 'roles.drafters_per_node': 2 leaves "
            "no target among 2 ranks per node") in text
    assert "(config)" not in text and "configured roles.drafters_per_node" not in text


def test_bench_cost_names_the_slower_configured_split(capsys):
    assert bench_cost.main(["--config", "configs/qwen3_8b.yaml", "roles.drafters_per_node=1"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"the configured split is predicted \d+\.\d\dx slower than the best", text)
    assert "the configured split is the best" not in text


@pytest.mark.parametrize("config,tp,heads", [("configs/qwen3_8b.yaml", 16, "32 attention heads and 8 key/value"),
                                             ("configs/llama3_70b_tp2.yaml", 3, "64 attention heads and 8 key/value")])
def test_bench_cost_refuses_a_tensor_parallel_split_that_cuts_heads(config, tp, heads, capsys):
    assert bench_cost.main(["--config", config, f"model.target.tensor_parallel={tp}", "--gpus-per-node", "8"]) == 2
    assert (f"error: config key 'model.target.tensor_parallel': {tp} does not divide the target's {heads}"
            in capsys.readouterr().err)


def test_bench_cost_checks_json_before_forecasting(tmp_path, monkeypatch, capsys):
    from helpers import read_only
    monkeypatch.setattr(C, "forecast", lambda *a, **k: pytest.fail("forecast ran before --json was checked"))
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        assert bench_cost.main(["--config", "configs/default.yaml", "--json", str(tmp_path / "ro" / "c.json")]) == 2
    assert f"error: --json {tmp_path / 'ro' / 'c.json'}: cannot write in {tmp_path / 'ro'}: " in capsys.readouterr().err
