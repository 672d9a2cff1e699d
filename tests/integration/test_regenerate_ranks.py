"""Chat regeneration as real processes (hf engine): two ranks under torchrun write what one writes;
SIGTERM to the torchrun agent stops after the chunk in hand (exit 75) and the same command resumes to
the same output."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for
from regen_fixtures import (
    ENV,
    ROOT,
    regen_argv,
    regen_cmd,
    target,  # noqa: F401  (fixtures)
)

from dflash_dist.bench.regenerate import conversations, write_jsonl
from dflash_dist.data.regen import chunks

pytestmark = pytest.mark.slow  # whole runs in subprocesses


def test_two_ranks_write_what_one_writes(target, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(30, seed=6) + ["{bad"])
    for n in (1, 2):
        res = subprocess.run(regen_cmd(n, regen_argv(target, src, tmp_path / f"out{n}.jsonl", "--chunk-size", "4")),
                             capture_output=True, text=True, timeout=240, env=ENV)
        assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "out1.jsonl").read_bytes() == (tmp_path / "out2.jsonl").read_bytes()
    meta = json.loads((tmp_path / "out2.meta.json").read_text())
    assert meta["conversations_out"] == 30 and meta["skipped"]["bad_json"] == 1 and meta["input_lines"] == 31
    assert "[rank1]" in res.stderr and "rank 1: 4 of its chunks to do" in res.stderr  # chunks 1, 3, 5, 7 of 8


def test_sigterm_stops_after_the_chunk_and_the_rerun_resumes(target, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(120, seed=7))
    whole = tmp_path / "whole.jsonl"
    one = subprocess.run(regen_cmd(1, regen_argv(target, src, whole, "--chunk-size", "4")), capture_output=True, text=True,
                         timeout=240, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    out = tmp_path / "out.jsonl"
    parts = chunks.parts_dir(out)
    log = open(tmp_path / "first.log", "w")
    # Two ranks through the launch script (set-up skipped: the tests' .venv has it), slow enough to stop.
    cmd = ["bash", str(ROOT / "launch" / "regenerate.sh"),
           *regen_argv(target, src, out, "--chunk-size", "4", "--batch-size", "1")]
    env = dict(ENV, NPROC="2", SKIP_SETUP="1", PYBIN=str(Path(sys.executable).parent))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: len(list(parts.glob("chunk-*.json"))) >= 2, 180, "two finished chunks")
        proc.send_signal(signal.SIGTERM)  # to the script: torchrun forwards it to both ranks
        assert proc.wait(timeout=120) == 75, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "first.log").read_text()
    done = len(list(parts.glob("chunk-*.json")))
    assert not out.exists() and 2 <= done < 30, text[-3000:]
    assert text.count("stopping after the current chunk is written") == 2, text[-3000:]
    assert "local ranks' exit codes: 75 75 -> exit 75" in text
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    import re
    todo = sum(int(n) for n in re.findall(r"rank \d: (\d+) of its chunks to do", again.stderr))
    assert todo == 30 - done, again.stderr[-3000:]  # finished chunks are not redone
    assert out.read_bytes() == whole.read_bytes()
    assert json.loads((tmp_path / "out.meta.json").read_text())["conversations_out"] == 120
