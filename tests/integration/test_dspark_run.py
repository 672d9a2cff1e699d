"""A DSpark run under torchrun (3 ranks, gloo: 2 drafters, 1 target sending its final hidden state beside
the features) on the tiny target: it trains (the loss falls), measures tau exactly in the run, exports
vLLM's Qwen3DSparkModel contract, and the evaluator decodes the export exactly, B drafts a block; a run
stopped mid-way resumes to the same weights (the Markov and confidence heads and their optimizer state are
checkpointed with the backbone); and colocated ranks, whose own target adds the final hidden state alike."""
import json
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from helpers import TINY, final_digest, interrupt, metrics, torchrun

pytestmark = pytest.mark.slow  # a whole run under torchrun

JOB = ["model.draft.variant=dspark", "model.draft.markov_rank=32", "roles.drafters_per_node=2", "train.epochs=2",
       "objective.anchor_chunk=3", "objective.loss_rows=40", "train.eval_prompts=4", "train.eval_new_tokens=24"]


def test_a_dspark_run_trains_exports_evaluates_and_resumes(tmp_path):
    run, stopped = tmp_path / "run", tmp_path / "stopped"
    res = torchrun(3, JOB, run, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tau_untrained"]["exact"] and summary["tau_trained"]["exact"]
    assert len(summary["acc_per_position"]) == 16  # every slot drafts, the first one included
    steps = [r for r in metrics(run) if r.get("kind") == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    conf = json.loads((run / "export" / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["markov_rank"] == 32
    tensors = load_file(str(run / "export" / "model.safetensors"))
    assert float(tensors["markov_head.markov_w2.weight"].float().abs().max()) > 0  # the Markov head trained
    out = tmp_path / "eval.json"
    ev = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(run / "export"), "--strict",
                         "--max-new-tokens", "24", "--json", str(out), *TINY, *JOB], capture_output=True, text=True,
                        timeout=300)
    assert ev.returncode == 0, (ev.stdout + ev.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["overall"]["exact"] and len(result["overall"]["accepted_per_position"]) == conf["block_size"]
    # the uninterrupted run above is the reference: stopped at step 3 (SIGTERM: checkpoint, exit 75) and
    # resumed, the same job must end on the same weights
    stopped.mkdir()
    first, _, _ = interrupt(3, JOB, stopped, 3, lambda p: p.send_signal(signal.SIGTERM), 90)
    assert "exit code 75: stopped on request" in first, first[-3000:]
    res = torchrun(3, JOB, stopped, timeout=400)
    again = res.stdout + res.stderr
    assert res.returncode == 0 and "resumed from" in again, again[-3000:]
    assert final_digest(stopped) == final_digest(run)


def test_a_colocated_dspark_run_trains_and_decodes_exactly(tmp_path):
    res = torchrun(2, JOB + ["roles.mode=colocated", "roles.drafters_per_node=1", "train.epochs=1"], tmp_path, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tau_trained"]["exact"] and summary["tau_trained"]["tau"] > summary["tau_untrained"]["tau"]
