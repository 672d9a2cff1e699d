"""The unit tier's guard (tests/unit/conftest.py): every way of starting a process refuses here."""
import multiprocessing
import os
import platform
import subprocess
import sys

import pytest
from process_guard import ATTEMPTS, StartedProcess


@pytest.mark.parametrize("start", [
    lambda: subprocess.run([sys.executable, "-c", "pass"]),
    lambda: os.fork(),
    lambda: os.system("true"),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
], ids=["subprocess", "fork", "system", "mp-fork", "mp-spawn"])
def test_every_way_of_starting_a_process_is_refused(start):
    with pytest.raises(StartedProcess):
        start()
    assert ATTEMPTS
    ATTEMPTS.clear()  # this test meant it


def test_a_refusal_the_code_swallows_is_still_recorded():
    """Code that can do without a process catches the refusal (an OSError, as a missing program): the
    attempt stays recorded, and tests/unit/conftest.py's hook fails such a test after its call."""
    try:
        subprocess.run(["true"])
    except OSError:
        pass
    assert ATTEMPTS == ["subprocess.Popen(['true'],)"]
    ATTEMPTS.clear()  # this test meant it


def test_bench_evaluate_records_the_machine_without_a_process():
    """platform.processor() runs `uname -p` on Linux: the machine comes from os.uname() instead."""
    from dflash_dist.bench.evaluate import machine_name
    assert machine_name() == os.uname().machine == platform.machine()
