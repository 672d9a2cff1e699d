"""Every registered drafter variant (`models.variants.VARIANTS`) under torchrun (3 ranks, gloo: 2 drafters,
1 target) on the tiny target: a run trains (the loss falls, each step record carries the variant's
figures), measures tau exactly in the run, exports the variant's contract with heads that trained, the
evaluator (`python -m dflash_dist.evaluate`, the project's decoder) decodes the export exactly, and a run
stopped mid-way (SIGTERM: a checkpoint, exit 75) resumes to the uninterrupted run's weights.

Asserted on records only: the workers' exit-code files ($DFLASH_EXIT_CODE_DIR), summary.json,
metrics.jsonl, the export and the evaluator's --json. It replaced test_dflash2_run.py, test_domino_run.py
and test_dspark_run.py's first test (the colocated DSpark run stays there)."""
import json
import signal
import subprocess
import sys

import pytest
import torch
from helpers import TINY, final_digest, interrupt, metrics, torchrun
from safetensors.torch import load_file
from variant_models import NAMES

from dflash_dist.config import load_config
from dflash_dist.evaluation.loading import load_drafter_checked
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.variants import RunProgress, variant_of
from dflash_dist.training.stats import StepStats

pytestmark = pytest.mark.slow  # whole runs under torchrun

CPU = torch.device("cpu")
JOB = ["roles.drafters_per_node=2", "train.epochs=2", "objective.anchor_chunk=3", "train.eval_prompts=4",
       "train.eval_new_tokens=24"]
# A variant's keys for a run at the tiny shape (its defaults are sized for real targets); DFlash 2 runs
# its drafters as FSDP2 shards, so one variant's extra modules are checkpointed and resumed sharded.
RUN_OPTIONS = {"dflash2": ["variant.selector_rank=32", "roles.drafter_sharding=fsdp"],
               "dspark": ["variant.markov_rank=32", "objective.loss_rows=40"],
               "domino": ["variant.gru_hidden_dim=32", "variant.emb_dim=16", "objective.loss_rows=40"]}
# The figures a built-in variant's step records carry beside its drafts' (`Variant.reported_figures` of its
# declared sums): written out here, so that a figure the variant stops reporting fails the check.
HEAD_FIGURES = {"dflash2": {"unary_acc", "unary_accept_len", "topk_recall", "selector_loss"},
                "domino": {"unary_acc", "unary_accept_len"}}
# Every step record's keys whatever the variant (roles/reporter.py); a variant's own come beside them.
STEP_KEYS = {"kind", "step", "epoch", "time", "step_batches", "step_seqs", "step_tokens", "loss", "acc", "accept_len",
             "grad_norm", "lr"}


def job(name: str) -> list[str]:
    return [f"model.draft.variant={name}", *JOB, *RUN_OPTIONS.get(name, [])]


def exit_codes(where) -> list[int]:
    return [int(f.read_text()) for f in sorted(where.glob("local-rank-*"))]


def check_training(run, name: str, cfg) -> None:
    variant = variant_of(name)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tau_untrained"]["exact"] and summary["tau_trained"]["exact"]
    # the trained slots: every slot of an anchor-as-first block, the first one included, else all but it
    block = cfg.objective.block_size
    assert len(summary["acc_per_position"]) == (block if variant.anchor_drafts else block - 1)
    steps = [r for r in metrics(run) if r.get("kind") == "step"]
    assert steps and steps[-1]["loss"] < steps[0]["loss"]
    # beside the fixed keys exactly the variant's figures: those its declared sums report (the registry's
    # object asked, at a step with blocks), which are the built-ins' named above, and its schedule's
    reported = set(variant.reported_figures(StepStats(block, blocks=1, figures=variant.figures)))
    assert reported == HEAD_FIGURES.get(name, set())
    want = reported | set(variant.step_figures(RunProgress(), cfg.variant))
    assert all(r.keys() - STEP_KEYS == want and STEP_KEYS <= r.keys() for r in steps), [sorted(r) for r in steps[:1]]
    # the variant's own figures (Domino's lambda): the schedule's values over the run's exact total
    for i, r in enumerate(steps):
        for k, v in variant.step_figures(RunProgress(i, len(steps)), cfg.variant).items():
            assert r[k] == pytest.approx(v), (i, k)


def check_export(export, name: str, cfg) -> None:
    """The variant's contract (architecture, projector type, its config keys: the run's spec read back) and
    every tensor that starts at zero (DSpark's W2, Domino's delta) moved off it: the head trained."""
    variant = variant_of(name)
    conf = json.loads((export / "config.json").read_text())
    assert conf["architectures"] == [variant.architecture]
    assert conf["dflash_config"].get("projector_type") == variant.projector_type
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    assert load_drafter_checked(export).spec == spec
    zero = [k for k, v in build_drafter(spec, target, 0, CPU).state_dict().items() if not v.any()]
    tensors = load_file(str(export / "model.safetensors"))
    assert all(tensors[k].float().abs().max() > 0 for k in zero), zero


def check_evaluate(export, name: str, out) -> None:
    ev = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(export), "--strict",
                         "--max-new-tokens", "24", "--json", str(out), *TINY, *job(name)], capture_output=True,
                        text=True, timeout=300)
    assert ev.returncode == 0, (ev.stdout + ev.stderr)[-4000:]
    overall = json.loads(out.read_text())["overall"]
    # the served drafts a block (DSpark B, Domino B - 1 as SGLang proposes them, DFlash B - 1)
    block = json.loads((export / "config.json").read_text())["block_size"]
    assert overall["exact"] and len(overall["accepted_per_position"]) == variant_of(name).drafts(block)


@pytest.mark.parametrize("name", NAMES)
def test_a_variant_run_trains_exports_evaluates_and_resumes(tmp_path, name):
    whole, stopped, codes = tmp_path / "whole", tmp_path / "stopped", tmp_path / "codes"
    for d in (stopped, codes / "whole", codes / "stopped", codes / "resumed"):
        d.mkdir(parents=True)
    cfg = load_config(overrides=[*TINY, *job(name)])
    res = torchrun(3, job(name), whole, timeout=400, env={"DFLASH_EXIT_CODE_DIR": str(codes / "whole")})
    assert res.returncode == 0 and exit_codes(codes / "whole") == [0, 0, 0], (res.stdout + res.stderr)[-4000:]
    check_training(whole, name, cfg)
    check_export(whole / "export", name, cfg)
    check_evaluate(whole / "export", name, tmp_path / "eval.json")
    # stopped at step 3 (every worker saves and exits 75), then the same job resumes to the same weights;
    # without its tau (evaluation changes no weight; the run above measured it), which halves its cost
    again = job(name) + ["train.eval_prompts=0"]
    log, _, _ = interrupt(3, again, stopped, 3, lambda p: p.send_signal(signal.SIGTERM), 90,
                          env={"DFLASH_EXIT_CODE_DIR": str(codes / "stopped")})
    assert exit_codes(codes / "stopped") == [75, 75, 75], log[-3000:]
    res = torchrun(3, again, stopped, timeout=400, env={"DFLASH_EXIT_CODE_DIR": str(codes / "resumed")})
    assert res.returncode == 0 and exit_codes(codes / "resumed") == [0, 0, 0], (res.stdout + res.stderr)[-3000:]
    plans = [r["step"] for r in metrics(stopped) if r.get("kind") == "plan"]
    assert len(plans) == 2 and plans[0] == 0 and plans[1] >= 3  # the second process started at the checkpoint
    assert final_digest(stopped) == final_digest(whole)
