"""One run per run directory: an exclusive lock held by rank 0 for the run's life, and a writability
check made before training.

The lock is `flock` on RUN_DIR/.lock. The kernel drops it when the holding process ends, however it
ends (exit, exception, SIGKILL, OOM kill), so a crashed run never leaves a stale lock to clean up. The
file's text (host, pid, start time) only names the holder in the refusal; it is never trusted as the
lock itself. On network filesystems flock works where the mount supports it (NFSv4 maps it to a
byte-range lock; Lustre needs the `flock` mount option); where it does not, the run goes on with a
warning.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from dflash_dist.config import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class RunLock:
    """`with RunLock(run_dir):` or `acquire()` / `release()`. Refuses (ConfigError) while another
    process holds the lock of the same directory. `what`: the key or flag the refusal names (regeneration
    locks its --output's parts directory)."""

    def __init__(self, run_dir: str | os.PathLike, what: str = "train.run_dir"):
        self.run_dir, self.what = Path(run_dir), what
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)  # no flock on this filesystem: nothing can be enforced here
                log.warning("cannot lock %s (%s): a second run on this %s would not be refused",
                            self.path, exc, self.what)
                return self
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"{self.what} {self.run_dir} is in use by another run ({holder}); wait for it "
                              f"to end or stop it, or choose another {self.what}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock. The file stays: unlinking it could let a third run lock a new inode while a
        second one still waits on the old one."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder not yet recorded"


def check_writable(run_dir: str | os.PathLike, subdirs: tuple[str, ...] = ("checkpoints", "export")) -> None:
    """ConfigError naming train.run_dir when it, or one of its `subdirs` that exists already (where the run
    writes checkpoints and the export), cannot be created or written (a read-only mount or directory, a
    path under a regular file, no permission, a full disk): found before any rank waits on another,
    instead of surfacing as a failed save or export hours later."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"config key 'train.run_dir': cannot create {run_dir}: {exc.strerror or exc}") from exc
    for d in [run_dir] + [run_dir / s for s in subdirs if (run_dir / s).is_dir()]:
        _probe(d)


def _probe(d: Path) -> None:
    probe = d / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"ok\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise ConfigError(f"config key 'train.run_dir': {d} is not writable: {exc.strerror or exc}") from exc
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
