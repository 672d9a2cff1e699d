"""A DFlash 2 run under torchrun (3 ranks, gloo: 2 FSDP2 drafters, 1 target) on the tiny target: it trains,
its step records carry the unary head's figures beside the selector's, it exports the DFlash 2 contract,
the evaluator decodes the export exactly, and a run stopped mid-way resumes to the same weights."""
import json
import signal
import subprocess
import sys

import pytest

from helpers import TINY, final_digest, interrupt, metrics, torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun

JOB = ["model.draft.variant=dflash2", "model.draft.selector_rank=32", "roles.drafters_per_node=2",
       "roles.drafter_sharding=fsdp", "train.epochs=2", "objective.anchor_chunk=3", "train.eval_prompts=4",
       "train.eval_new_tokens=24"]


def test_a_dflash2_run_trains_exports_evaluates_and_resumes(tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    res = torchrun(3, JOB, whole, timeout=300)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["tau_untrained"]["exact"] and summary["tau_trained"]["exact"]
    steps = [r for r in metrics(whole) if r.get("kind") == "step"]
    assert steps and all({"unary_acc", "unary_accept_len", "topk_recall", "selector_loss"} <= r.keys() for r in steps)
    conf = json.loads((whole / "export" / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["dflash_config"]["selector_rank"] == 32
    out = tmp_path / "eval.json"
    ev = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(whole / "export"), "--strict",
                         "--max-new-tokens", "24", "--json", str(out), *TINY, *JOB], capture_output=True, text=True,
                        timeout=300)
    assert ev.returncode == 0, (ev.stdout + ev.stderr)[-4000:]
    assert json.loads(out.read_text())["overall"]["exact"]
    stopped.mkdir()
    first, _, _ = interrupt(3, JOB, stopped, 3, lambda p: p.send_signal(signal.SIGTERM), 90)
    assert "exit code 75: stopped on request" in first, first[-3000:]
    res = torchrun(3, JOB, stopped, timeout=300)
    again = res.stdout + res.stderr
    assert res.returncode == 0 and "resumed from" in again, again[-3000:]
    assert final_digest(stopped) == final_digest(whole)
