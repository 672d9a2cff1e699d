"""Issue 44 end to end: `python -m dflash_dist.data.prepare` on a user's own chat data (two-turn reasoning,
tool calls and results, two sources mixed with a weight, a held-out split, the target's context from its
config) with a Qwen3-style ChatML tokenizer, then a short training run under torchrun on the result."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from chat_fixtures import CHATML_EOT, make_chatml_tokenizer, write_jsonl

from dflash_dist.data.disk import open_dataset
from dflash_dist.evaluation.prompts import read_prompt_file

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]


def reasoning_line(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Add {i} and 1?"},
                         {"role": "assistant", "content": f"{i + 1}.", "reasoning_content": f"R{i}a: {i}+1={i + 1}."},
                         {"role": "user", "content": "Double it?"},
                         {"role": "assistant", "content": f"<think>\nR{i}b: twice.\n</think>\n\n{2 * i + 2}."}]}


def tool_line(i: int) -> dict:
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": f"Compute {i}*3."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": json.dumps({"x": f"{i}*3"})}}]},
        {"role": "tool", "content": f"RESULT{3 * i}", "name": "calc"},
        {"role": "assistant", "content": f"It is {3 * i}."}]}


def prepare_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_dist.data.prepare", *args]


@pytest.mark.slow
def test_own_chat_data_prepares_and_trains(tmp_path):
    from helpers import torchrun

    tok = make_chatml_tokenizer(tmp_path / "tok")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"max_position_embeddings": 480}))
    a = write_jsonl(tmp_path / "reasoning.jsonl", [json.dumps(reasoning_line(i)) for i in range(24)])
    b = write_jsonl(tmp_path / "tools.jsonl", [json.dumps(tool_line(i)) for i in range(12)]
                    + [json.dumps(tool_line(0) | {"messages": tool_line(0)["messages"] * 4})])  # > 480 tokens
    out = tmp_path / "ds"
    r = subprocess.run(prepare_cmd("--tokenizer", str(tok), "--target-config", str(target), "--input", str(a),
                                   "--input", f"{b}:2", "--heldout", "3", "--workers", "2", "--output", str(out)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    meta = json.loads((out / "meta.json").read_text())
    # Never past the target's positions: the long line's samples over 480 tokens are skipped, each counted.
    assert meta["max_length"] == 480 and meta["skipped"]["over_length"] >= 1
    assert int(np.diff(open_dataset(out).offsets).max()) <= 480
    sa, sb = meta["sources"]
    assert [s["lines"] for s in summary["sources"]] == [24, 13] and sa["heldout"] + sb["heldout"] == 3
    assert sb["draws"] == 2 * sb["samples"]  # weight 2: each tool line's samples written twice
    assert meta["num_samples"] == sa["draws"] + sb["draws"]
    # Every reasoning text of every held-in turn trained, every call supervised, no tool result.
    ds = open_dataset(out)
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tok)
    texts = [(t.decode(ds.sample(i)[0].tolist()), t.decode(ds.sample(i)[0][ds.sample(i)[1] == 1].tolist()))
             for i in range(len(ds))]
    sup = "".join(s for _, s in texts)
    held = {p[0] for p in read_prompt_file(out / "heldout.jsonl").items}
    assert len(held) == 3
    for i in range(24):
        if f"Add {i} and 1?" not in held:
            assert f"R{i}a: {i}+1={i + 1}." in sup and f"R{i}b: twice." in sup
    for i in range(12):
        if f"Compute {i}*3." not in held:
            assert f'"arguments": {{"x": "{i}*3"}}}}\n</tool_call>{CHATML_EOT}' in sup
    assert "RESULT" not in sup and any("RESULT" in full for full, _ in texts)
    assert meta["replies"]["reasoning_left_out"] == 0

    run = tmp_path / "run"
    res = torchrun(3, [f"data.path={out}", "plan.token_budget=512"], run, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    result = json.loads((run / "summary.json").read_text())
    assert result["samples"] > 0 and result["samples"] % meta["num_samples"] == 0  # every sample, each epoch
    assert all(np.isfinite(e["loss"]) for e in result["epochs"])
    assert result["prepared_sources"] == meta["sources"]  # the run's record names what it was mixed from


def test_no_thinking_reaches_the_workers_templates(tmp_path):
    """--no-thinking and --chat-template-kwargs travel to every worker: replies generated with thinking off are
    supervised from their first written token (the template's empty think block is the prompt)."""
    tok = make_chatml_tokenizer(tmp_path / "tok")
    lines = [json.dumps({"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Yo {i}."}]})
             for i in range(6)]
    src = write_jsonl(tmp_path / "c.jsonl", lines)
    outs = {}
    for name, flags in (("default", []), ("off", ["--no-thinking", "--chat-template-kwargs", '{"unused": 1}'])):
        r = subprocess.run(prepare_cmd("--tokenizer", str(tok), "--input", str(src), "--workers", "2",
                                       "--output", str(tmp_path / name), *flags),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        outs[name] = open_dataset(tmp_path / name)
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tok)
    for i in range(6):
        ids, mask = outs["off"].sample(i)
        assert t.decode(ids[mask == 1].tolist()) == f"Yo {i}.{CHATML_EOT}"
        assert "<think>\n\n</think>\n\n" in t.decode(ids.tolist())
        ids, mask = outs["default"].sample(i)  # not told: the empty block is trained as the reply's
        assert t.decode(ids[mask == 1].tolist()) == f"<think>\n\n</think>\n\nYo {i}.{CHATML_EOT}"
    assert outs["off"].meta["made_by"]["options"]["template_kwargs"] == {"unused": 1, "enable_thinking": False}
