"""vLLM's CPU thread binding (data/regen/vllm_cpu.py) left as vLLM chooses it (the measured effect of the
alternative: docs/benchmarks.md, "vLLM on CPU: one core or both"), in both of the project's vLLM engines.
vLLM's LLM is replaced by a recorder: no engine starts here."""
from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from dflash_dist.data.regen import vllm_cpu
from dflash_dist.data.regen.vllm_cpu import RESERVED


class Recorder:
    """Stands for vllm.LLM: records the environment the engine-core process would inherit."""
    seen: list[dict] = []

    def __init__(self, **kw):
        Recorder.seen.append({"env": os.environ.get(RESERVED), "kw": kw})
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))


@pytest.fixture
def recorder(monkeypatch):
    import vllm
    monkeypatch.setattr(vllm, "LLM", Recorder)
    monkeypatch.setattr(vllm_cpu, "usable_cores", lambda: 2)
    monkeypatch.delenv(RESERVED, raising=False)
    Recorder.seen = []
    return Recorder


@pytest.mark.slow  # imports vLLM (10-60 s)
@pytest.mark.parametrize("engine", ["regen", "evaluate"])
def test_both_vllm_engines_note_the_binding_and_keep_vllms(recorder, engine, caplog):
    caplog.set_level(logging.INFO, logger="dflash_dist.data.regen.vllm_cpu")
    if engine == "regen":
        from dflash_dist.data.regen.engine import EngineSpec
        from dflash_dist.data.regen.vllm import VllmEngine
        VllmEngine(EngineSpec(name="vllm", target="T", tokenizer="T"), stop_ids=[])
    else:
        from dflash_dist.evaluation.vllm_engine import VllmOptions, _llm
        _llm(VllmOptions(target="T", draft="D", block_size=4, context=64), "ngram")
    assert [s["env"] for s in recorder.seen] == [None]  # vLLM's own binding: one core reserved
    assert "binds its model worker to 1 of the 2 cores" in caplog.text


@pytest.mark.slow
def test_ngram_baseline_proposes_as_many_tokens_as_the_drafter(recorder):
    from dflash_dist.evaluation.vllm_engine import VllmOptions, _llm
    for method in ("target", "ngram", "dflash"):
        _llm(VllmOptions(target="T", draft="D", block_size=16, context=64), method)
    configs = [s["kw"].get("speculative_config") for s in recorder.seen]
    assert configs == [None, {"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_max": 4,
                              "prompt_lookup_min": 2},
                       {"method": "dflash", "model": "D", "num_speculative_tokens": 15}]
