"""`evaluate --engine vllm` asks the installed vLLM whether it can serve the export before any engine
starts: vLLM 0.32's CPU build (Model Runner V1) refuses DSpark and DFlash 2's candidate head, so such an
export exits 2 with vLLM's own reason, without the target-only engine's minutes first; a DFlash export
passes the same question. No engine starts in these tests (an engine start fails them)."""
from __future__ import annotations

import logging

import pytest
from evaluate_fixtures import prompts, target_overrides, untrained_export

from dflash_dist.evaluate import main
from dflash_dist.evaluation import vllm_engine

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def no_engine(monkeypatch):
    def started(*a, **k):
        raise AssertionError("an engine started")
    monkeypatch.setattr(vllm_engine, "_llm", started)


@pytest.mark.parametrize("variant, refusal", [("dspark", "dspark speculative decoding"),
                                              ("dflash2", "DFlash candidate-head drafts")])
def test_an_export_the_installed_vllm_cannot_serve_is_refused_before_any_engine(tmp_path, caplog, no_engine,
                                                                                variant, refusal):
    target, export = untrained_export(tmp_path, f"model.draft.variant={variant}")
    path = prompts(tmp_path, "[1, 2, 3]\n")
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        rc = main(["--draft", str(export), "--bench", path, "--engine", "vllm", *target_overrides(target),
                   f"model.draft.variant={variant}"])
    err = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert rc == 2 and f"--draft {export}" in err and "cannot serve" in err and refusal in err, err


def test_a_dflash_export_passes_the_question(tmp_path):
    target, export = untrained_export(tmp_path)
    vllm_engine.check_servable(vllm_engine.VllmOptions(target=str(target), draft=str(export), block_size=4,
                                                       context=1024, max_model_len=256))
