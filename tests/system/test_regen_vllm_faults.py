"""Regeneration on vLLM under a fault: the engine's processes die with a killed rank."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for
from regen_fixtures import (
    ENV,
    descendants_left,
    fault_argv,
    target,  # noqa: F401  (fixtures)
)

from dflash_dist.bench.regenerate import conversations, write_jsonl
from dflash_dist.data.regen import chunks


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_engine_processes_die_with_a_killed_rank(target, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(400, seed=7))
    out = tmp_path / "out.jsonl"
    args = [a if a != "hf" else "vllm" for a in fault_argv(target, src, out, "--chunk-size", "8", "--kv-cache-gib", "0.25")]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_dist.data.regenerate", *args], env=ENV, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    from dflash_dist.data.regen.reaper import descendants
    engine_procs: dict[int, int] = {}
    try:
        wait_for(lambda: (chunks.parts_dir(out) / "chunk-000000.json").exists(), 600, "a finished chunk")
        engine_procs.update({p: s for p, s in descendants(proc.pid).items()
                        if b"VLLM" in Path(f"/proc/{p}/cmdline").read_bytes()
                        or b"VLLM" in Path(f"/proc/{p}/comm").read_bytes()})
        assert engine_procs, (tmp_path / "run.log").read_text()[-3000:]
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in descendants_left(engine_procs)), 30,
                 "the engine processes to die")
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in descendants_left(engine_procs):
            os.kill(p, signal.SIGKILL)
