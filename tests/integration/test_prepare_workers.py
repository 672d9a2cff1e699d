"""python -m dflash_dist.data.prepare with worker processes: the command with workers equals the
in-process result, a hostile line is a counted skip with its line number with 2 workers too, and the
prepared dataset trains under torchrun."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
from chat_fixtures import (
    corpus_lines,
    openai,
    tok_dir,  # noqa: F401  (fixtures)
    write_jsonl,
)

from dflash_dist.data.disk import open_dataset
from dflash_dist.data.prepare import Options, prepare


def test_cli_with_workers_matches_in_process(tok_dir, tmp_path):
    lines, expected = corpus_lines()
    src = write_jsonl(tmp_path / "chat.jsonl", lines * 3)
    prepare(str(tok_dir), str(src), str(tmp_path / "ref"), Options(max_length=150, no_reasoning_loss=True))
    cmd = [sys.executable, "-m", "dflash_dist.data.prepare", "--tokenizer", str(tok_dir), "--input", str(src),
           "--output", str(tmp_path / "cli"), "--max-length", "150", "--no-reasoning-loss", "--workers", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["num_samples"] == 9 and summary["skipped"]["over_length"] == 3
    ref, cli = open_dataset(tmp_path / "ref"), open_dataset(tmp_path / "cli")
    for name in ("tokens", "offsets", "loss_mask"):
        assert np.array_equal(getattr(ref, name), getattr(cli, name)), name
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # output exists, no --overwrite
    assert again.returncode == 1 and "already exists" in again.stderr


HOSTILE = [
    "[" * 100_000 + "]" * 100_000,  # nested past Python's recursion limit: json.loads raises RecursionError
    '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok."}]}',
    '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", '
    '"text": "\\udfff"}]}]}',  # a lone low surrogate in a content part
]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_deeply_nested_or_surrogate_line_is_a_counted_skip_with_its_line_number(tok_dir, tmp_path, caplog, workers):
    lines, expected = corpus_lines()
    src = write_jsonl(tmp_path / "chat.jsonl", lines + HOSTILE)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.prepare"):
        meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options(max_length=150), workers=workers)
    n = len(lines)
    assert meta["num_samples"] == 3 and meta["made_by"]["input_lines"] == n + 3
    assert {k: v for k, v in meta["skipped"].items() if v} == dict(expected, bad_json=2, bad_text=2)
    assert re.search(rf"chat\.jsonl:{n + 1}: skipped \(bad_json\): not valid JSON: RecursionError", caplog.text)
    assert f"chat.jsonl:{n + 2}: skipped (bad_text): message 0: not valid Unicode text (surrogates not allowed" \
        in caplog.text
    assert f"chat.jsonl:{n + 3}: skipped (bad_text): message 1:" in caplog.text
    assert open_dataset(tmp_path / "ds").meta["skipped"] == meta["skipped"]


@pytest.mark.slow
def test_prepared_dataset_trains_under_torchrun(tok_dir, tmp_path):
    """Issue 4's end: chat JSONL -> prepare -> `data.path=DIR` under torchrun with 3 ranks (2 targets, 1 drafter)."""
    from helpers import torchrun

    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "why", "is", "sky", "blue", "light", "scatters", "4", "ok."]
    say = lambda k: " ".join(rng.choice(words, size=k))  # noqa: E731
    convs = [openai([("user", say(rng.integers(2, 8))), ("assistant", say(rng.integers(3, 25)))]) for _ in range(90)]
    lines = [json.dumps(c) for c in convs] + ["{broken", json.dumps(openai([("user", "long " * 60), ("assistant", "x")]))]
    src = write_jsonl(tmp_path / "chat.jsonl", lines)
    meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options(max_length=200))
    assert meta["num_samples"] == 90 and meta["skipped"]["bad_json"] == 1 and meta["skipped"]["over_length"] == 1

    run = tmp_path / "run"
    res = torchrun(3, [f"data.path={tmp_path / 'ds'}", "plan.token_budget=512"], run)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["samples"] == 3 * 90  # every prepared sample once per epoch
    assert summary["skipped_in_preparation"]["bad_json"] == 1 and summary["skipped_in_preparation"]["over_length"] == 1
    assert all(np.isfinite(e["loss"]) for e in summary["epochs"])
    assert (run / "export" / "model.safetensors").is_file()
