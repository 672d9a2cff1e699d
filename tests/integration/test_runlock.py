"""The run-directory lock between processes: a second run on the same run dir is refused naming the
holder, and the lock of a killed run is free at once."""
import os
import signal
import subprocess
import sys

import pytest

from dflash_dist.config import ConfigError
from dflash_dist.io.runlock import RunLock

HOLD = """
import sys, time
from dflash_dist.io.runlock import RunLock
from dflash_dist.config import ConfigError
try:
    lock = RunLock(sys.argv[1]).acquire()
except ConfigError as e:
    print("REFUSED", e, flush=True)
    sys.exit(2)
print("HELD", flush=True)
if sys.argv[2] == "crash":
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(float(sys.argv[2]))
"""


def _hold(run_dir, how):
    return subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), how], stdout=subprocess.PIPE, text=True)


def test_a_second_run_on_the_same_run_dir_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path) as lock:
        assert lock.held
        other = _hold(tmp_path, "0")
        out, _ = other.communicate(timeout=60)
        assert other.returncode == 2
        assert f"REFUSED train.run_dir {tmp_path} is in use by another run (host " in out
        assert f"pid {os.getpid()} since " in out and "choose another train.run_dir" in out
    assert not lock.held
    # Released: another process gets it, and then this one is refused.
    holder = _hold(tmp_path, "30")
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} since"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_run_is_free_at_once(tmp_path):
    crashed = _hold(tmp_path, "crash")
    assert crashed.stdout.readline().strip() == "HELD"
    assert crashed.wait(timeout=60) == -signal.SIGKILL
    assert (tmp_path / ".lock").read_text().startswith("host ")  # its record stays, the lock does not
    with RunLock(tmp_path) as lock:
        assert lock.held
