"""The unit tier's guard against starting a process (tests/unit/conftest.py installs it): every way this
process could start another one (subprocess, os.fork/posix_spawn/system, multiprocessing's start, the spawn
helper behind multiprocessing and torch.multiprocessing) refuses, and the attempt is recorded so that a
test fails even where the code under test caught the refusal."""
from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import subprocess

ATTEMPTS: list[str] = []  # what tried to start a process during the current test


class StartedProcess(OSError):
    """What a process start raises under the guard: an OSError, as a missing program is, so that code
    which can do without one (matplotlib without fontconfig's fc-list) takes its own way round; a test
    whose code tried still fails, the attempt being recorded (ATTEMPTS)."""


def refuse(what: str):
    def refused(*args, **kwargs):
        ATTEMPTS.append(f"{what}{args[1:2] if what == 'subprocess.Popen' else ''}")
        raise StartedProcess(f"the unit tier starts no process: {what} was called (move the test to "
                             "tests/integration, or keep the code under test in-process)")
    return refused


GUARDED = [(subprocess.Popen, "_execute_child", "subprocess.Popen"),
           (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
           (multiprocessing.util, "spawnv_passfds", "multiprocessing.util.spawnv_passfds")]
GUARDED += [(os, name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
            if hasattr(os, name)]
