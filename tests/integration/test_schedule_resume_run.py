"""The schedules across a resume on another layout (issue 46 case 8): a Domino run under torchrun (3 ranks,
gloo) stopped with 2 drafters and resumed with 1 continues its lambda (and learning-rate) schedule from the
checkpoint's place. Domino's own run contract (train, export, evaluate, resume) is the registry's, in
test_variant_runs.py."""
import re
import signal

import pytest
from helpers import interrupt, metrics, torchrun

from dflash_dist.models.variants.domino.options import DominoOptions
from dflash_dist.models.variants.domino_loss import domino_lambda

pytestmark = pytest.mark.slow  # whole runs under torchrun

JOB = ["model.draft.variant=domino", "variant.gru_hidden_dim=32", "variant.emb_dim=16",
       "roles.drafters_per_node=2", "train.epochs=2", "objective.anchor_chunk=3", "objective.loss_rows=40",
       "train.eval_prompts=4", "train.eval_new_tokens=24"]


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
    fraction = DominoOptions().lambda_fraction
    assert lam[s0] == pytest.approx(domino_lambda(s0, total, fraction))  # step s0 + 1: the record after s0
    assert all(a >= b for a, b in zip(lam, lam[1:])), lam
