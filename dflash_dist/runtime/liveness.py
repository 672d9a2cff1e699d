"""Dead peers: heartbeats in the rendezvous store and a watchdog that ends a rank whose peer went silent.

A blocked send/recv or collective has no idea which peer is gone, and under NCCL it may block until
the process-group timeout. So every rank runs one thread that (1) bumps its own counter key in the
c10d store every `heartbeat_s`, and (2) reads every other rank's key: a counter that has not moved for
`dead_after_s` (measured on this rank's clock, so clocks need not agree), or a rank that marked itself
failed, ends this process with an error naming that rank and its role. A rank that finished cleanly
marks itself done and is never reported. The thread uses only the store, never a collective. Here, in the
runtime's ground floor rather than beside the process groups in parallel/, because regeneration's ranks
(in data/, below parallel/; they share no process group, only torchrun's store) watch each other with it
too.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch.distributed as dist

from dflash_dist.exits import EXIT_PEER_LOST, record_exit_code

log = logging.getLogger(__name__)

DONE, FAILED = "done", "failed:"


class Liveness:
    def __init__(self, rank: int, world: int, role_of, heartbeat_s: float, dead_after_s: float, store=None,
                 dead_after_name: str = "dist.dead_after_s"):
        self.rank, self.world, self.role_of = rank, world, role_of
        self.dead_after_name = dead_after_name  # the setting named when a peer is reported silent
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.prefix = f"dflash/hb/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._run, name="dflash-liveness", daemon=True)
        self.store.set(self._key(rank), "0")

    def _key(self, r: int) -> str:
        return f"{self.prefix}{r}"

    def start(self) -> "Liveness":
        """Call after a collective that follows every rank's first heartbeat (so all keys exist)."""
        self._thread.start()
        return self

    def mark(self, status: str, exit_code: int | None = None) -> None:
        """DONE on a clean exit, FAILED + reason on an error: peers stop waiting for us at once. With
        `exit_code`, the peers end with that code too (their failure is this one, e.g. a divergence)."""
        self._stop.set()
        if exit_code is not None and status.startswith(FAILED):
            status = f"{FAILED}{exit_code}:{status[len(FAILED):]}"
        try:
            self.store.set(self._key(self.rank), status[:500])
        except Exception:  # the store may be gone with its host; nothing left to tell
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.heartbeat_s + 1)

    def await_peers(self, timeout_s: float) -> "Liveness":
        """For ranks without a collective to follow their first heartbeats (regeneration): wait until every
        rank's key is in the store (torch's TimeoutError after `timeout_s`), then start."""
        import datetime
        self.store.wait([self._key(r) for r in range(self.world)], datetime.timedelta(seconds=timeout_s))
        return self.start()

    def await_verdict(self, seconds: float) -> None:
        """Sleep while the watchdog looks for a dead peer; it ends the process if it finds one."""
        deadline = time.monotonic() + seconds
        while self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _run(self) -> None:
        last: dict[int, tuple[str, float]] = {}
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [self._key(r) for r in peers]
        while not self._stop.wait(self.heartbeat_s):
            self._beats += 1
            try:
                self.store.set(self._key(self.rank), str(self._beats))
                values = [v.decode() for v in self.store.multi_get(keys)]
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._die(f"lost the rendezvous store ({exc}); its host (the torchrun agent of the first node) is gone")
            now = time.monotonic()
            for r, v in zip(peers, values):
                if v.startswith(FAILED):
                    code, _, why = v[len(FAILED):].partition(":")
                    if code.isdigit():
                        self._die(f"rank {r} ({self.role_of(r)}) failed: {why}", int(code))
                    self._die(f"rank {r} ({self.role_of(r)}) failed: {v[len(FAILED):]}")
                if v == DONE:
                    continue
                if r not in last or last[r][0] != v:
                    last[r] = (v, now)
                elif now - last[r][1] > self.dead_after_s:
                    self._die(f"rank {r} ({self.role_of(r)}) went silent: no heartbeat for "
                              f"{now - last[r][1]:.1f}s ({self.dead_after_name}={self.dead_after_s:g})")

    def _die(self, why: str, code: int = EXIT_PEER_LOST) -> None:
        if self._stop.is_set():
            return  # we are finishing anyway
        log.error("%s; exiting instead of waiting on it", why)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        record_exit_code(code)  # os._exit skips the caller's own record; launch/run.sh reads this one
        os._exit(code)
