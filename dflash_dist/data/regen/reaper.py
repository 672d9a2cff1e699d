"""The vLLM engine's processes die with their rank, whatever kills it.

vLLM runs its engine core (and, with tensor parallelism, its workers) in child processes. They shut down
when the rank exits normally, but a rank killed outright (kill -9, the OOM killer, torchrun's SIGKILL after
its grace) leaves them running, holding the model and the KV cache: a GPU's memory on a node. They cannot
be told by PR_SET_PDEATHSIG: vLLM starts them itself (and may spawn them, which clears any setting made here).

So before the engine starts, the rank starts this watchdog: a small process that ignores the stop signals
(a stop is the rank's to handle), records the rank's descendants every POLL_S, and once the rank is gone
SIGKILLs those still running (each checked by its start time, so a reused pid is never hit), then exits.
multiprocessing's resource tracker is left to end by itself: it does when the last process holding its
pipe is gone, after removing the shared memory they leaked.

    python -m dflash_dist.data.regen.reaper PID
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)

POLL_S = 0.5
SPARED = "multiprocessing.resource_tracker"


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) of a live process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start and st[2] not in ("Z", "X")


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live process below `root`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    out, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid not in out:
                out[pid] = start
                todo.append(pid)
    return out


def _spared(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return SPARED.encode() in f.read()
    except OSError:
        return True  # gone already


def watch(rank: int, poll_s: float = POLL_S) -> int:
    """Until `rank` ends; then SIGKILL its descendants that outlived it. Returns how many were killed."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    me, first = os.getpid(), _stat(rank)
    if first is None:
        return 0
    seen: dict[int, int] = {}
    while _alive(rank, first[1]):
        seen.update(descendants(rank))
        seen.pop(me, None)
        time.sleep(poll_s)
    killed = 0
    for pid, start in seen.items():
        if _alive(pid, start) and not _spared(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    if killed:
        log.warning("rank process %d is gone: killed %d engine processes it left running", rank, killed)
    return killed


def start() -> subprocess.Popen:
    """The watchdog for this process (call before the engine starts its children)."""
    return subprocess.Popen([sys.executable, "-m", "dflash_dist.data.regen.reaper", str(os.getpid())],
                            stdin=subprocess.DEVNULL, close_fds=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reaper: %(message)s")
    watch(int(sys.argv[1]))
