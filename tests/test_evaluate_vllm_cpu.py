"""vLLM's CPU thread setting (data/regen/vllm_cpu.py): the rule, and that both of the project's vLLM engines
(regeneration's and the evaluation's) start vLLM with it. vLLM's LLM is replaced by a recorder: no engine
starts here (the measured effect is docs/benchmarks.md's "vLLM on CPU: one core or both")."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from dflash_dist.data.regen import vllm_cpu
from dflash_dist.data.regen.vllm_cpu import RESERVED, cpu_thread_env


def test_small_machines_give_the_worker_every_core():
    assert cpu_thread_env(2, {}) == {RESERVED: "0"}
    assert cpu_thread_env(4, {"OMP_NUM_THREADS": "1"}) == {RESERVED: "0"}
    assert cpu_thread_env(2, {RESERVED: "1"}) == {}  # the user's choice wins
    assert cpu_thread_env(16, {}) == {}  # one reserved core of many: vLLM's default stays


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
    monkeypatch.setenv(RESERVED, "")  # recorded, so that the engines' setting is undone after the test
    monkeypatch.delenv(RESERVED)
    Recorder.seen = []
    return Recorder


@pytest.mark.slow  # imports vLLM (10-60 s)
@pytest.mark.parametrize("engine", ["regen", "evaluate"])
def test_both_vllm_engines_start_with_the_setting(recorder, engine):
    if engine == "regen":
        from dflash_dist.data.regen.engine import EngineSpec
        from dflash_dist.data.regen.vllm import VllmEngine
        VllmEngine(EngineSpec(name="vllm", target="T", tokenizer="T"), stop_ids=[])
    else:
        from dflash_dist.evaluation.vllm_engine import VllmOptions, _llm
        _llm(VllmOptions(target="T", draft="D", block_size=4), "ngram")
    assert [s["env"] for s in recorder.seen] == ["0"]


@pytest.mark.slow
def test_ngram_baseline_proposes_as_many_tokens_as_the_drafter(recorder):
    from dflash_dist.evaluation.vllm_engine import VllmOptions, _llm
    for method in ("target", "ngram", "dflash"):
        _llm(VllmOptions(target="T", draft="D", block_size=16), method)
    configs = [s["kw"].get("speculative_config") for s in recorder.seen]
    assert configs == [None, {"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_max": 4,
                              "prompt_lookup_min": 2},
                       {"method": "dflash", "model": "D", "num_speculative_tokens": 15}]
