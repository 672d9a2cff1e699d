"""`evaluate --engine vllm` under a fault: the engines' processes die with a killed or stopped evaluation,
and a conversation that grows past the context is an input error naming its line and turn."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from evaluate_fixtures import make_export, target_overrides, write_jsonl
from helpers import wait_for
from regen_fixtures import descendants_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("vllm-faults"))


def evaluate_cmd(export, bench: Path, *extra: str) -> list[str]:
    model_dir, draft = export
    return [sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(draft), "--bench", str(bench),
            "--engine", "vllm", "--kv-cache-gib", "0.25", *extra, *target_overrides(model_dir)]


def engine_processes(pid: int) -> dict[int, int]:
    """{pid: start time} of the vLLM processes below `pid` (vLLM names its engine core VLLM::EngineCore)."""
    from dflash_dist.data.regen.reaper import descendants
    found = {}
    for p, start in descendants(pid).items():
        try:
            if b"VLLM" in Path(f"/proc/{p}/cmdline").read_bytes() or b"VLLM" in Path(f"/proc/{p}/comm").read_bytes():
                found[p] = start
        except OSError:
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_engines_die_with_the_evaluation(export, tmp_path, sig):
    # Enough decoding that the engine is still busy when the signal comes.
    bench = write_jsonl(tmp_path / "ids.jsonl", [[3 + i, 17, 42, 99, 5, 8] for i in range(64)])
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(evaluate_cmd(export, bench, "--max-new-tokens", "512"), env=ENV, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    engines: dict[int, int] = {}
    try:
        engines = wait_for(lambda: engine_processes(proc.pid), 300, "the first vLLM engine's processes")
        proc.send_signal(sig)
        proc.wait(timeout=30)
        wait_for(lambda: not descendants_left(engines), 30, "the engine processes to die")
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in descendants_left(engines):
            os.kill(p, signal.SIGKILL)


def test_a_later_turn_past_the_context_is_an_input_error_naming_line_and_turn(export, tmp_path):
    """Turn 1 fits the 64 positions, turn 2 does not: exit 2 naming the line and the turn once the
    engine has answered turn 1 (as the hf engine does), not a traceback from inside vLLM."""
    bench = write_jsonl(tmp_path / "chat.jsonl", [{"turns": ["hi"]}, {"turns": ["hello", "word " * 80]}])
    res = subprocess.run(evaluate_cmd(export, bench, "--max-new-tokens", "8", "--max-model-len", "64"), env=ENV,
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-4000:]
    assert f"{bench}:2 turn 2: prompt of" in out and "the target's context of 64 positions" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
