"""Bad input to `python -m dflash_dist.evaluate`: exit 2 and a message naming the file, line or flag;
never a traceback, never a silent tau of 0.000 (issue 19, item 8)."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from evaluate_fixtures import (
    B4,
    draft,  # noqa: F401  (fixtures)
    prompts,
)

from dflash_dist.evaluate import main

CPU = torch.device("cpu")


def run(argv, caplog) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        rc = main(argv)
    return rc, "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


@pytest.mark.parametrize("content, where, says", [
    ("[1, 2, 3]\n[5, 128, 7]\n", ":2", "token id 128 outside the target's vocabulary [0, 128)"),
    ("[1, 2, 3]\n\n[5, -1, 7]\n", ":3", "token id -1 outside"),
    ("", "", "no prompts in the file"),
    ("\n\n", "", "no prompts in the file"),
    ("[1, 2]\n{not json\n", ":2", "not valid JSON"),
    ("[" * 100000 + "]" * 100000 + "\n", ":1", "not valid JSON"),  # nested past the recursion limit
    ("[1, 2]\n[]\n", ":2", "a non-empty list of token ids"),
    ("[1, 2]\n[1.5, 2]\n", ":2", "a non-empty list of token ids"),
    ('{"turns": []}\n', ":1", "\"turns\" must be a non-empty list of non-empty strings"),
    ('{"turns": ["hi", 3]}\n', ":1", "\"turns\" must be a non-empty list"),
    ('[1, 2]\n{"turns": ["hi"]}\n', ":2", "one kind per file"),
])
def test_bad_prompt_files_name_file_and_line(tmp_path, caplog, draft, content, where, says):
    path = prompts(tmp_path, content)
    rc, err = run(["--draft", str(draft), "--bench", path, "--max-new-tokens", "2", B4], caplog)
    assert rc == 2 and f"{path}{where}:" in err and says in err, err


def test_conversations_need_a_tokenizer_target(tmp_path, caplog, draft):
    path = prompts(tmp_path, '{"turns": ["hello"]}\n')
    rc, err = run(["--draft", str(draft), "--bench", path, B4], caplog)
    assert rc == 2 and path in err and "model.target.kind=hf" in err, err


@pytest.mark.parametrize("flag, value", [("--max-new-tokens", "0"), ("--max-new-tokens", "-3"),
                                         ("--num-prompts", "0"), ("--kv-cache-gib", "0.0"),
                                         ("--kv-cache-gib", "-0.5")])
def test_bad_flags_are_named(caplog, draft, flag, value):
    rc, err = run(["--draft", str(draft), flag, value, B4], caplog)
    assert rc == 2 and f"{flag} {value}: must be a positive number" in err, err


def test_baselines_need_the_vllm_engine(caplog, draft):
    rc, err = run(["--draft", str(draft), "--baselines", B4], caplog)
    assert rc == 2 and "--baselines" in err and "--engine vllm" in err, err


def test_unknown_bench_name_and_unreachable_public_set(tmp_path, caplog, draft, monkeypatch):
    rc, err = run(["--draft", str(draft), "--bench", "gsm9k", B4], caplog)
    assert rc == 2 and "--bench gsm9k: no such file" in err and "gsm8k" in err, err
    # No `datasets` (or no Hub) here: the message says which file to provide instead.
    monkeypatch.setitem(sys.modules, "datasets", None)
    rc, err = run(["--draft", str(draft), "--bench", "mt-bench", "--bench-dir", str(tmp_path), B4], caplog)
    assert rc == 2 and f"provide {tmp_path / 'mt-bench.jsonl'}" in err and '{"turns"' in err, err
    # Provided, it is used under the benchmark's name (and its lines are checked like any file's).
    (tmp_path / "mt-bench.jsonl").write_text('{"turns": ["hi"]}\n[1]\n')
    rc, err = run(["--draft", str(draft), "--bench", "mt-bench", "--bench-dir", str(tmp_path), B4], caplog)
    assert rc == 2 and f"{tmp_path / 'mt-bench.jsonl'}:2:" in err, err


def copy_export(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_damaged_export_is_named(tmp_path, caplog, draft):
    bad = copy_export(draft, tmp_path / "truncated")
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    rc, err = run(["--draft", str(bad), B4], caplog)
    assert rc == 2 and f"{w}: cannot load the drafter weights" in err, err

    nocfg = copy_export(draft, tmp_path / "no_dflash_config")
    cfg = json.loads((nocfg / "config.json").read_text())
    del cfg["dflash_config"]
    (nocfg / "config.json").write_text(json.dumps(cfg))
    rc, err = run(["--draft", str(nocfg), B4], caplog)
    assert rc == 2 and f"{nocfg / 'config.json'}: missing dflash_config" in err, err

    (nocfg / "config.json").write_text("{trunc")
    rc, err = run(["--draft", str(nocfg), B4], caplog)
    assert rc == 2 and f"{nocfg / 'config.json'}: not readable JSON" in err, err

    rc, err = run(["--draft", str(tmp_path / "nowhere"), B4], caplog)
    assert rc == 2 and f"--draft {tmp_path / 'nowhere'}: no config.json" in err, err


def test_a_drafter_of_another_target_is_refused(caplog, draft):
    rc, err = run(["--draft", str(draft), "model.target.vocab_size=96", "--max-new-tokens", "2"], caplog)
    assert rc == 2 and "does not fit the target: vocab_size 128 (drafter) != 96 (target)" in err, err


def test_named_benchmarks_are_cached_as_turns_files(tmp_path, monkeypatch):
    """With `datasets` reachable (a stand-in here: CI has no Hub), each public set becomes NAME.jsonl in the
    conversation format, worded as z-lab's benchmark sends it; mt-bench keeps its turns."""
    import types

    from dflash_dist.evaluation.prompts import load_bench
    rows = {"openai/gsm8k": [{"question": "2 + 3?"}], "HuggingFaceH4/MATH-500": [{"problem": "x^2 = 4"}],
            "openai/openai_humaneval": [{"prompt": "def f(x):\n"}], "google-research-datasets/mbpp": [{"prompt": "sort it"}],
            "HuggingFaceH4/mt_bench_prompts": [{"prompt": ["first", "second"]}]}
    calls = []

    def load_dataset(name, *config, split):
        calls.append((name, config, split))
        return rows[name]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    step = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    want = {"gsm8k": [["2 + 3?" + step]], "math500": [["x^2 = 4" + step]],
            "humaneval": [["Write a solution to the following problem and make sure that it passes the tests:\n"
                           "```python\ndef f(x):\n\n```"]],
            "mbpp": [["sort it"]], "mt-bench": [["first", "second"]]}
    for name, items in want.items():
        pset = load_bench(name, tmp_path)
        assert (pset.name, pset.kind, pset.items) == (name, "turns", items)
        assert json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[0]) == {"turns": items[0]}
    assert ("openai/gsm8k", ("main",), "test") in calls and ("google-research-datasets/mbpp", ("sanitized",), "test") in calls
    n = len(calls)
    load_bench("gsm8k", tmp_path)  # cached: not loaded again
    assert len(calls) == n


def test_the_vllm_engine_refuses_a_drafter_of_another_target_before_any_engine_starts(tmp_path, caplog, draft):
    """The hf engine's fit check, in the vLLM engine too: before vLLM is imported (an engine start is
    minutes on a CPU and a GPU's memory on a node), exit 2 naming both numbers."""
    from evaluate_fixtures import save_target, target_overrides
    model_dir = save_target(tmp_path / "target")  # 4 layers
    other = copy_export(draft, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_target_layers"] = 6
    (other / "config.json").write_text(json.dumps(cfg))
    had_vllm = "vllm" in sys.modules
    rc, err = run(["--draft", str(other), "--engine", "vllm", *target_overrides(model_dir)], caplog)
    assert rc == 2 and "does not fit the target" in err and "num_target_layers 6 (drafter) != 4 (target)" in err, err
    assert had_vllm or "vllm" not in sys.modules, "the check must come before the engine"


def test_settings_that_contradict_the_export_are_refused_naming_the_keys(tmp_path, caplog):
    """A Domino export of block 4 evaluated with `model.draft.variant=dspark objective.block_size=8`: the
    export fixes the drafter, so the two keys would be ignored and Domino measured at block 4 without a
    word; exit 2 naming both, before anything is decoded. The same keys at the export's values pass."""
    from evaluate_fixtures import target_overrides, untrained_export
    target, export = untrained_export(tmp_path, "model.draft.variant=domino", "variant.gru_hidden_dim=8",
                                      "variant.emb_dim=8")
    path = prompts(tmp_path, "[1, 2, 3]\n")
    base = ["--draft", str(export), "--bench", path, "--max-new-tokens", "2", *target_overrides(target)]
    rc, err = run([*base, "model.draft.variant=dspark", "objective.block_size=8"], caplog)
    assert rc == 2 and "model.draft.variant=dspark (the export's domino)" in err \
        and "objective.block_size=8 (the export's 4)" in err, err
    rc, err = run([*base, "variant.gru_hidden_dim=16"], caplog)
    assert rc == 2 and "variant.gru_hidden_dim=16 (the export's 8)" in err, err
    out = tmp_path / "ok.json"
    rc, err = run(["--json", str(out), *base, "model.draft.variant=domino", "variant.gru_hidden_dim=8"], caplog)
    assert rc == 0 and json.loads(out.read_text())["block_size"] == 4, err
