"""Issue 45's Done-when: a fifth variant is one object and one registration, nothing else. `Toy` is
defined here only -- its typed options (the score head's width, the term's weight: the config's `variant`
section), its module (a zero-initialised linear score head on the final states), its loss term (beside the
unary loss), its export contract (`projector_type: toy`) and its forecast terms -- and
registered in every spawned process by DFLASH_VARIANTS=test_toy_variant:Toy (this file, by its import
path). A run under torchrun (2 drafters on torch's DDP, 1 target) trains it, exports it, the evaluator
loads the export back as a Toy drafter and decodes exactly, and a run stopped mid-way resumes to the same
weights. No file outside this one names the toy."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torch import nn

from dflash_dist.config import num
from dflash_dist.models.variants import PLUGINS_ENV, LossChunk, Variant
from dflash_dist.models.variants.forecast import VariantForecast


@dataclass(frozen=True)
class ToyModel:
    score_dim: int = num(1, ge=1)  # the score head's outputs (exported in dflash_config)


@dataclass(frozen=True)
class ToyOptions(ToyModel):
    weight: float = num(0.01, ge=0)  # the toy term's weight beside the unary cross-entropy


class ToyForecast(VariantForecast):
    """The score head's parameters; every other answer the interface's default (DFlash's: nothing)."""

    def params(self, s, cfg) -> int:
        return (s.hidden + 1) * cfg.variant.score_dim  # the score head's weight and bias


class Toy(Variant):
    """The plain DFlash drafter plus a score head trained towards 1 on every labelled slot."""
    name = "toy"
    title = "Toy"
    projector_type = "toy"  # what tells the export apart from a plain DFlashDraftModel's
    forecast = ToyForecast()
    Model, Options = ToyModel, ToyOptions
    config_keys = ("score_dim",)

    def heads(self, spec) -> dict[str, nn.Module]:
        head = nn.Linear(spec.hidden_size, spec.options.score_dim)
        nn.init.zeros_(head.weight)  # so a trained head is one that is not zero
        nn.init.zeros_(head.bias)
        return {"toy_head": head}

    def loss_term(self, model, hidden, chunk: LossChunk, loss_sum, metrics, top, options):
        score = model.toy_head(hidden.float())  # (A, B, score_dim)
        term = options.weight * (chunk.weights[..., None] * (score - 1.0) ** 2).sum()
        return loss_sum + term, replace(metrics, loss_sum=metrics.loss_sum + term.detach())

    def config_fields(self, spec) -> dict:
        return {"dflash_config": {"block_size": spec.block_size, "projector_type": self.projector_type,
                                  "score_dim": spec.options.score_dim}}


pytestmark = pytest.mark.slow  # whole runs under torchrun

HERE = Path(__file__).resolve().parent
JOB = ["model.draft.variant=toy", "roles.drafters_per_node=2", "roles.drafter_sharding=ddp", "train.epochs=2",
       "objective.anchor_chunk=3", "variant.score_dim=2", "variant.weight=0.02"]


@pytest.fixture
def toy_env(monkeypatch):
    """Every process the test spawns imports this file by name and registers Toy (this process's registry
    is left as it is: the other tests of a session see the built-ins only)."""
    path = [str(HERE), str(HERE.parent / "support"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    monkeypatch.setenv(PLUGINS_ENV, f"{Path(__file__).stem}:Toy")


def test_a_variant_defined_in_a_test_trains_exports_evaluates_and_resumes(tmp_path, toy_env):
    from helpers import TINY, final_digest, interrupt, metrics, torchrun
    run, stopped = tmp_path / "run", tmp_path / "stopped"
    res = torchrun(3, JOB, run, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    steps = [r for r in metrics(run) if r.get("kind") == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    conf = json.loads((run / "export" / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["dflash_config"]["projector_type"] == "toy"
    assert conf["dflash_config"]["score_dim"] == 2
    tensors = load_file(str(run / "export" / "model.safetensors"))
    assert tensors["toy_head.weight"].shape == (2, conf["hidden_size"])
    assert float(tensors["toy_head.weight"].float().abs().max()) > 0  # trained away from its zero init
    out = tmp_path / "eval.json"
    ev = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(run / "export"), "--strict",
                         "--max-new-tokens", "16", "--num-prompts", "2", "--json", str(out), *TINY, *JOB],
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, (ev.stdout + ev.stderr)[-4000:]
    assert json.loads(out.read_text())["overall"]["exact"]
    # the uninterrupted run is the reference: stopped at step 3 (SIGTERM: a checkpoint, no summary) and
    # resumed, the same job ends on the same weights (the toy head and its optimizer state are checkpointed)
    stopped.mkdir()
    interrupt(3, JOB, stopped, 3, lambda p: p.send_signal(signal.SIGTERM), 90)
    assert not (stopped / "summary.json").exists() and any((stopped / "checkpoints").iterdir())
    res = torchrun(3, JOB, stopped, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert final_digest(stopped) == final_digest(run)


def test_an_unregistered_variant_is_refused_naming_the_key(tmp_path):
    # without DFLASH_VARIANTS the name is no variant's: exit 2 right after loading, before any group forms
    env = dict(os.environ, **{PLUGINS_ENV: ""})
    res = subprocess.run([sys.executable, "-m", "dflash_dist.train", "wandb.mode=disabled", "model.draft.variant=toy",
                          f"train.run_dir={tmp_path}"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, (res.stdout + res.stderr)[-4000:]
    assert "'model.draft.variant'" in res.stderr


def test_a_bad_toy_option_is_refused_naming_its_key(tmp_path, toy_env):
    # its options are typed and checked like the built-ins': exit 2 right after loading, naming the key
    res = subprocess.run([sys.executable, "-m", "dflash_dist.train", "wandb.mode=disabled", "model.draft.variant=toy",
                          "variant.weight=-1", f"train.run_dir={tmp_path}"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, (res.stdout + res.stderr)[-4000:]
    assert "'variant.weight': must be a finite number >= 0" in res.stderr
