"""Chat regeneration as real processes on vLLM: launch/regenerate.sh gives the same conversations with
--engine vllm and --engine hf, and the output prepares with data.prepare and trains under torchrun; the
benchmark reports both engines; Slurm's SIGUSR2 to every process keeps the chunk in hand."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import torchrun, wait_for
from regen_fixtures import (
    ENV,
    ROOT,
    regen_argv,
    regen_cmd,
    target,  # noqa: F401  (fixtures)
)

from dflash_dist.bench.regenerate import conversations, write_jsonl
from dflash_dist.data.regen import chunks

pytestmark = pytest.mark.slow  # whole runs in subprocesses


def test_launch_script_engines_agree_and_the_output_prepares_and_trains(target, tmp_path):
    from dflash_dist.data.prepare import Options, prepare
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(60, seed=8))
    outs = {}
    for engine in ("vllm", "hf"):
        out = tmp_path / f"{engine}.jsonl"
        argv = regen_argv(target, src, out, "--chunk-size", "30")
        argv[argv.index("--engine") + 1] = engine
        # SKIP_SETUP: the set-up it would run (VLLM=1 EXTRAS=hf launch/setup.sh) is what CI's launch/test.sh ran.
        res = subprocess.run(["bash", str(ROOT / "launch" / "regenerate.sh"), *argv, "--kv-cache-gib", "0.25"],
                             capture_output=True, text=True, timeout=900, cwd=tmp_path,
                             env=dict(ENV, SKIP_SETUP="1", PYBIN=str(Path(sys.executable).parent)))
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"vllm engine: {target}" in res.stderr if engine == "vllm" else "hf engine:" in res.stderr
        outs[engine] = out.read_bytes()
    assert outs["vllm"] == outs["hf"]
    meta = prepare(str(target), str(tmp_path / "vllm.jsonl"), str(tmp_path / "ds"), Options())
    assert meta["num_samples"] == 60 and not any(meta["skipped"].values())
    run = tmp_path / "run"
    res = torchrun(3, [f"data.path={tmp_path / 'ds'}", "plan.token_budget=1024", "model.target.kind=hf",
                       f"model.target.path={target}", "model.draft.target_layer_ids=[0]", "train.epochs=1"],
                   run, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["samples"] == 60 and all(e["loss"] == e["loss"] for e in summary["epochs"])
    assert (run / "export" / "model.safetensors").is_file()


def test_benchmark_runs_and_reports_both_engines(tmp_path, capsys):
    from dflash_dist.bench.regenerate import main
    out = tmp_path / "bench.json"
    assert main(["--conversations", "8", "--max-new-tokens", "8", "--reps", "2", "--dir", str(tmp_path / "w"),
                 "--json", str(out), "--rate-per-rank", "10000"]) == 0
    res = json.loads(out.read_text())
    assert [e["engine"] for e in res["engines"]] == ["hf", "vllm"] and res["identical"] is True
    assert all(len(e["job_s_all"]) == 2 for e in res["engines"])
    assert res["engines"][0]["new_tokens"] == res["engines"][1]["new_tokens"] > 0
    # 1.35e9 tokens / (8 x 10,000 tok/s) = 16,875 s, plus vLLM's start-up once.
    p = res["projections"]["--rate-per-rank"]
    assert abs(p["hours"] - (16_875 + res["engines"][1]["start_s"]) / 3600) < 1e-9
    assert "vllm / hf tokens/s" in capsys.readouterr().out


def test_slurms_usr2_to_every_process_keeps_the_chunk_in_hand(target, tmp_path):
    """Slurm's --signal reaches every process of the step, vLLM's engine core too: the engine must not die
    of it (its children start with SIGUSR2 blocked), so the rank writes the chunk in hand and exits 75."""
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(400, seed=7))
    out = tmp_path / "out.jsonl"
    parts = chunks.parts_dir(out)
    argv = [a if a != "hf" else "vllm" for a in regen_argv(target, src, out, "--chunk-size", "8")]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(regen_cmd(1, argv), stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        wait_for(lambda: len(list(parts.glob("chunk-*.json"))) >= 2, 240, "two finished chunks")
        os.killpg(proc.pid, signal.SIGUSR2)  # as Slurm signals a job step: every process of it
        assert proc.wait(timeout=120) == 75, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "run.log").read_text()
    assert "received SIGUSR2: stopping after the current chunk is written" in text, text[-3000:]
    assert "the engine failed" not in text and "this chunk is lost" not in text, text[-3000:]
