"""Regeneration's ranks watch each other: heartbeats through torchrun's rendezvous store.

The ranks share no process group (each runs its own engine), so a rank that dies (SIGKILL, OOM, a lost
node) used to leave rank 0 polling for its chunk files forever. Here every rank of a torchrun world runs
runtime/liveness.py's heartbeat thread on the store torchrun already hosts (MASTER_ADDR:MASTER_PORT),
as training's ranks do: a peer silent for --dead-after-s is named and every rank exits 3 ("a peer died",
which slurm/job.sh requeues as a crash, never 75); a peer that fails marks itself so and the others exit
with its code at once. A few keys of the same store order the run:

    GO       rank 0 took the run lock on --output and claimed the parts directory: the job key, as JSON
    STOPPED  some rank stopped on request (75): ranks with no chunk in hand stop too (the same command resumes)
    END      rank 0 finished (merged or stopped): the others leave only then, so the agent hosting the
             store outlives rank 0's merge and every rank keeps watching rank 0 until it is done
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import time

from dflash_dist.exits import EXIT_BAD_INPUT, EXIT_RESUME
from dflash_dist.runtime.liveness import DONE, FAILED, Liveness

log = logging.getLogger(__name__)

GO, STOPPED, END = "dflash/regen/go", "dflash/regen/stopped", "dflash/regen/end"
POLL_S = 0.5


class PeerLost(RuntimeError):
    """A rank did not join within the start-up bound (exit 3)."""


class Peers:
    def __init__(self, rank: int, world: int, heartbeat_s: float, dead_after_s: float, join_s: float):
        import torch.distributed as dist
        self.rank, self.world = rank, world
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            raise ValueError(f"WORLD_SIZE={world} without MASTER_ADDR and MASTER_PORT: start several ranks with "
                             "torchrun (launch/regenerate.sh with NPROC, or slurm/regenerate.sbatch)")
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=join_s))
        self.liveness = Liveness(rank, world, lambda r: "regeneration", heartbeat_s, dead_after_s, store=self.store,
                                 dead_after_name="--dead-after-s")
        try:
            self.liveness.await_peers(join_s)
        except Exception as exc:  # torch's timeout (a DistStoreError / RuntimeError)
            missing = [r for r in range(world) if not self.store.check([self.liveness._key(r)])]
            raise PeerLost(f"rank(s) {missing} did not start within {join_s:g} s ({exc})") from exc

    def wait_for(self, key: str, stopped) -> bool:
        """Until `key` is set (True), or this rank or a peer stopped on request (False). A peer that dies
        meanwhile ends this process through the watchdog."""
        while not self.store.check([key]):
            if stopped() or self.store.check([STOPPED]):
                return False
            time.sleep(POLL_S)
        return True

    def go(self, key: dict) -> None:
        self.store.set(GO, json.dumps(key))

    def job_key(self) -> dict:
        return json.loads(self.store.get(GO))

    def peer_stopped(self) -> bool:
        return self.store.check([STOPPED])

    def leave(self, code: int, why: str = "") -> None:
        """Say how this rank ends: done, stopped (the others stop where they hold nothing), or failed with
        `code` (the others exit with the same code: a bad input or a full disk is every rank's)."""
        try:
            if code == EXIT_RESUME:
                self.store.set(STOPPED, str(self.rank))
            if self.rank == 0 and code in (0, EXIT_RESUME):
                self.store.set(END, str(code))
        except Exception as exc:  # the store's host is gone: nothing left to tell
            log.warning("cannot reach the rendezvous store to say this rank ends (%s)", exc)
        if code in (0, EXIT_RESUME):
            self.liveness.mark(DONE)
        else:
            # A bad input or a full disk is every rank's (exit 2 everywhere); any other failure is a peer lost.
            self.liveness.mark(f"{FAILED}{why or f'exit {code}'}",
                               exit_code=code if code == EXIT_BAD_INPUT else None)
        self.liveness.stop()
