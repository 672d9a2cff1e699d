"""A colocated DSpark run under torchrun (2 ranks, gloo), whose own target adds the final hidden state to
the features as a target rank sends it: it trains and decodes exactly. (The 3-rank run, its export, the
evaluator and the resume: tests/integration/test_variant_runs.py, as every variant's.)"""
import json

import pytest
from helpers import torchrun

pytestmark = pytest.mark.slow  # a whole run under torchrun

JOB = ["model.draft.variant=dspark", "variant.markov_rank=32", "roles.drafters_per_node=2", "train.epochs=2",
       "objective.anchor_chunk=3", "objective.loss_rows=40", "train.eval_prompts=4", "train.eval_new_tokens=24"]


def test_a_colocated_dspark_run_trains_and_decodes_exactly(tmp_path):
    res = torchrun(2, JOB + ["roles.mode=colocated", "roles.drafters_per_node=1", "train.epochs=1"], tmp_path, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tau_trained"]["exact"] and summary["tau_trained"]["tau"] > summary["tau_untrained"]["tau"]
