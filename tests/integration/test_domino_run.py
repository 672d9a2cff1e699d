"""A Domino run under torchrun (3 ranks, gloo: 2 drafters, 1 target) on the tiny target: it trains (the loss
falls, the GRU head learns), measures tau exactly in the run, exports SGLang's Domino contract, the
evaluator decodes the export exactly with B - 1 drafts a block (SGLang's); and a run stopped mid-way resumes to the same
weights, which it reaches only if its lambda schedule continues from the checkpoint's step (lambda weighs
every step's gradient)."""
import json
import re
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from helpers import TINY, final_digest, interrupt, metrics, torchrun

from dflash_dist.config import ObjectiveConfig
from dflash_dist.models.variants.domino_loss import domino_lambda

pytestmark = pytest.mark.slow  # whole runs under torchrun

JOB = ["model.draft.variant=domino", "model.draft.gru_hidden_dim=32", "model.draft.domino_emb_dim=16",
       "roles.drafters_per_node=2", "train.epochs=2", "objective.anchor_chunk=3", "objective.loss_rows=40",
       "train.eval_prompts=4", "train.eval_new_tokens=24"]


def test_a_domino_run_trains_exports_evaluates_and_resumes(tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    res = torchrun(3, JOB, whole, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["tau_untrained"]["exact"] and summary["tau_trained"]["exact"]
    assert len(summary["acc_per_position"]) == 16  # every slot drafts, the first one included
    steps = [r for r in metrics(whole) if r.get("kind") == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    # each step's record: its lambda (1 at the first step, the schedule over the run's exact total) and the
    # base logits' figures as the unary head's beside the drafts'
    fraction = ObjectiveConfig().domino_lambda_fraction
    assert [r["domino_lambda"] for r in steps] == pytest.approx([domino_lambda(i, len(steps), fraction)
                                                                 for i in range(len(steps))])
    assert steps[0]["domino_lambda"] == 1.0
    assert all({"unary_acc", "unary_accept_len"} <= r.keys() and "topk_recall" not in r for r in steps)
    conf = json.loads((whole / "export" / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["dflash_config"]["projector_type"] == "domino"
    tensors = load_file(str(whole / "export" / "model.safetensors"))
    assert float(tensors["embed_proj.2.weight"].float().abs().max()) > 0  # the head trained (it starts at zero)
    out = tmp_path / "eval.json"
    ev = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(whole / "export"), "--strict",
                         "--max-new-tokens", "24", "--json", str(out), *TINY, *JOB], capture_output=True, text=True,
                        timeout=300)
    assert ev.returncode == 0, (ev.stdout + ev.stderr)[-4000:]
    result = json.loads(out.read_text())
    # B - 1 drafts a block, as SGLang proposes them: a step accepts 0..B-1 of them
    assert result["overall"]["exact"] and len(result["overall"]["accepted_per_position"]) == conf["block_size"] - 1
    stopped.mkdir()
    first, _, _ = interrupt(3, JOB, stopped, 3, lambda p: p.send_signal(signal.SIGTERM), 90)
    assert "exit code 75: stopped on request" in first, first[-3000:]
    res = torchrun(3, JOB, stopped, timeout=400)
    again = res.stdout + res.stderr
    assert res.returncode == 0 and "resumed from" in again, again[-3000:]
    assert final_digest(stopped) == final_digest(whole)


def test_a_resume_on_another_layout_continues_the_lambda_schedule(tmp_path):
    """Stopped at step 3 of a 2-drafter run, resumed with 1 drafter (twice the steps left): the first
    resumed step's lambda is the one the stopped run would have used there, and lambda never rises (it
    rose 0.875 -> 0.893 before the schedules continued across layouts, issue 46 case 8); the resume says
    the rest of the schedule was re-planned."""
    first, _, _ = interrupt(3, JOB, tmp_path, 3, lambda p: p.send_signal(signal.SIGTERM), 90)
    assert "exit code 75: stopped on request" in first, first[-3000:]
    res = torchrun(3, [*JOB, "roles.drafters_per_node=1"], tmp_path, timeout=400)
    again = res.stdout + res.stderr
    assert res.returncode == 0, again[-3000:]
    s0 = int(re.search(r"resumed from \S*step-(\d+)", again).group(1))
    assert "on another layout" in again and "re-planned" in again, again[-3000:]
    plan = next(r for r in metrics(tmp_path) if r.get("kind") == "plan" and r["num_drafters"] == 2)
    total = sum(-(-n // 2) for n in plan["epoch_counts"])  # the stopped run's optimizer steps
    steps = [r for r in metrics(tmp_path) if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    lam = [r["domino_lambda"] for r in steps]
    fraction = ObjectiveConfig().domino_lambda_fraction
    assert lam[s0] == pytest.approx(domino_lambda(s0, total, fraction))  # step s0 + 1: the record after s0
    assert all(a >= b for a, b in zip(lam, lam[1:])), lam
