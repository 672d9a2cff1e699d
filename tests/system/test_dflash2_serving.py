"""Why vLLM's CPU build cannot serve a DFlash 2 draft (docs/serving.md), asked of vLLM itself: the
selector's walk exists only in Model Runner V2's DFlash2 speculator, V2 needs Triton (the CPU wheel has no
Triton CPU backend, so vLLM picks V1), and V1 refuses candidate-head drafts rather than serve the unary
head silently. Real subprocesses with a hard timeout; vLLM is part of CI's install (never skipped)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from evaluate_fixtures import save_target, target_overrides

from dflash_dist.config import load_config
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.export import export_drafter, serving_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROBE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
target, spec = sys.argv[1], json.loads(sys.argv[2])
try:
    EngineArgs(model=target, speculative_config=spec, max_model_len=256).create_engine_config()
except Exception as exc:
    print("REFUSED", type(exc).__name__, " ".join(str(exc).split()))
else:
    print("ACCEPTED")
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2_serving")
    model_dir = save_target(root / "target")
    cfg = load_config(overrides=target_overrides(model_dir) + ["model.draft.variant=dflash2"])
    target = build_target(cfg, torch.device("cpu"))
    spec = draft_spec(cfg, target)
    drafter = build_drafter(spec, target, seed=0, device=torch.device("cpu"))
    return model_dir, export_drafter(spec, drafter.state_dict(), root / "draft", dtype=torch.float32), spec


def probe(model_dir, draft, spec, **env) -> str:
    settings = serving_settings(spec, str(draft), str(model_dir))["vllm"]["speculative_config"]
    import json
    res = subprocess.run([sys.executable, "-c", PROBE, str(model_dir), json.dumps(settings)], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    out = [line for line in res.stdout.splitlines() if line.startswith(("REFUSED", "ACCEPTED"))]
    assert res.returncode == 0 and out, (res.stdout + res.stderr)[-4000:]
    return out[-1]


def test_vllm_cpu_picks_v1_which_refuses_a_dflash2_draft(export):
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in probe(*export)


def test_vllm_cpu_cannot_run_model_runner_v2(export):
    assert "Model Runner V2 requires Triton" in probe(*export, VLLM_USE_V2_MODEL_RUNNER="1")
