"""Durable writes: the one atomic file write (atomic_write), the one atomic directory write (AtomicDir) and
the one temporary-name rule both use (temp_sibling), for every stage that writes (checkpoints, datasets,
summaries, caches, benchmark results, from_gguf's and export's model folders). Every file and folder
they leave gets the mode the umask gives (umask_modes), whatever wrote it: other users' jobs read a shared
target. An output that exists and is not a regular file (a character device such as /dev/null, a FIFO)
is written through as it is, never replaced by a regular file (atomic_write, check_output_path). A
temporary that a killed writer left (SIGKILL, a power cut) is removed by the next write of the same
destination on the same host (remove_stale_temps); SIGTERM, with terminate_cleanly, removes its own.
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from dflash_dist.io.write_errors import os_errors

log = logging.getLogger(__name__)

TMP_TAG = ".tmp-"  # in every temporary name: readers refuse it and start-up clean-ups look for it
# The writer's host in every temporary name: a pid says whether its writer still runs only on that host
# (a shared filesystem holds other nodes' temporaries too, whose pids mean nothing here).
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_TEMP_NAME = re.compile(r"(tmp|old)-(\d+)-([0-9a-f]{6})[0-9a-f]{8}")  # after ".NAME.": tag, pid, host, random


def fsync_dir(path: Path) -> None:
    """Persist a directory entry (a rename into `path`), not only the files' contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path, tag: str = "tmp") -> Path:
    """The one temporary-name rule: `.NAME.tmp-PID-HOSTRANDOM` beside `path`. A sibling, so the rename stays
    on one filesystem (only there is it atomic); hidden, so no glob of final names picks it up; the pid, the
    host's tag and the random part keep racing writers (ranks, jobs, nodes) apart and tell a killed one's
    (temp_writer). `tag` "old" names a destination moved aside by AtomicDir."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{HOST_TAG}{secrets.token_hex(4)}")


def temp_writer(path: Path, tmp: Path) -> tuple[int, bool | None] | None:
    """(pid, alive) of the writer of `tmp` when it is one of temp_sibling's names for `path`, else None.
    alive is None where that cannot be told: a temporary of another host."""
    prefix = f".{path.name}."
    m = _TEMP_NAME.fullmatch(tmp.name[len(prefix):]) if tmp.name.startswith(prefix) else None
    if m is None:
        return None
    pid = int(m.group(2))
    return pid, (pid_alive(pid) if m.group(3) == HOST_TAG else None)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def temp_siblings(path: Path) -> list[tuple[Path, int, bool | None]]:
    """(temporary, pid, alive) of every temporary of `path` beside it (temp_writer)."""
    out = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:  # no parent yet, or not readable: nothing of ours there
        return out
    for e in entries:
        if (w := temp_writer(path, Path(e.path))) is not None:
            out.append((Path(e.path), *w))
    return out


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove what killed writers of `path` on this host left beside it: temporaries whose pid no longer
    runs (a SIGKILL, an OOM kill, a power cut give a writer no chance to). A live writer's, and another
    host's, are left alone. A destination moved aside ("old") while `path` is missing is the last whole
    version (the kill fell between AtomicDir's two renames): it is put back, not removed. Returns what
    was removed or put back."""
    done = []
    for tmp, _pid, alive in temp_siblings(path):
        if alive is not False:
            continue
        try:
            if tmp.name[len(path.name) + 2:].startswith("old-") and not os.path.lexists(path):
                os.replace(tmp, path)
            elif tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
        except FileNotFoundError:  # another cleaner's, meanwhile
            continue
        done.append(tmp)
    if done:
        log.warning("removed what killed writers of %s left: %s", path, ", ".join(p.name for p in done))
    return done


# The temporary directories this process is writing, each registered before it is created and released
# when its writer commits or aborts it: one that an exit interrupts where no clean-up of the writer's can
# run (a SIGTERM raised between the mkdir and the `with` block or try that would abort it, in a
# constructor or between two statements) is removed at exit. Keyed by path, valued by the pid that made
# it: a forked child's exit must not remove its parent's.
_UNFINISHED: dict[Path, int] = {}


def _claim(tmp: Path) -> None:
    _UNFINISHED[tmp] = os.getpid()


def _release(tmp: Path) -> None:
    _UNFINISHED.pop(tmp, None)


@atexit.register
def remove_unfinished() -> list[Path]:
    """Remove this process's registered temporaries (at exit: SystemExit from terminate_cleanly's
    SIGTERM included). Returns what was removed."""
    done = []
    for tmp, pid in list(_UNFINISHED.items()):
        if pid == os.getpid():
            shutil.rmtree(tmp, ignore_errors=True)
            _release(tmp)
            done.append(tmp)
    return done


def terminate_cleanly() -> None:
    """Make SIGTERM raise SystemExit(143) in the main thread, so a command-line job stopped by a user or
    a scheduler unwinds: atomic_write and AtomicDir remove their temporaries on the way out, where the
    default action would end the process at once and leave them behind. 143 is the code SIGTERM's
    default gives (128 + 15)."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the clean-up ends it at once
        log.warning("SIGTERM: stopping; removing what was half written")
        raise SystemExit(128 + signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[BinaryIO], object]) -> Path:
    """Write `path` atomically: a reader (or a crash) sees the old file or the new one, never a part.
    `data` is text (written as UTF-8), bytes, or a callback that writes into the open binary file (for
    writers that take a file object: torch.save, np.savez, json.dump). The temporary is fsynced before
    the rename and the directory after it, so the new file survives a power cut once this returns; on
    any failure (the callback's included) the temporary is removed and the old file is left as it was.
    A `path` that exists and is not a regular file (/dev/null, a FIFO, /dev/stdout's target) is opened
    and written as it is: renaming over it would replace the device node or pipe with a file."""
    path = Path(path)
    if is_special(path):
        with open(path, "wb") as f:
            _write(f, data)
        return path
    remove_stale_temps(path)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "xb") as f:  # open's mode is 0o666 less the umask (mkstemp's would be 0600)
            _write(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _write(f: BinaryIO, data: str | bytes | Callable[[BinaryIO], object]) -> None:
    if callable(data):
        with os_errors():  # torch.save's RuntimeError over the file's own ENOSPC: the OSError it is
            data(f)
    else:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def is_special(path: Path) -> bool:
    """True when `path` (its symlinks followed) exists and is neither a regular file nor a directory: a
    character or block device, a FIFO, a socket. Such an output is written through, never renamed over."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def current_umask() -> int:
    """The process's umask, read from /proc (Linux) so that no other thread creates a file under a
    zeroed umask meanwhile; elsewhere by setting it and setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def umask_modes(root: Path) -> None:
    """Give `root` and everything under it the mode the umask gives (0o666 or 0o777 for folders, less the
    umask). Writers that go through a temporary (mkdtemp, safetensors' save_file) leave 0700/0600, which
    hides a shared target or export from other users' jobs; symlinks are left alone."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for top, dirs, names in os.walk(root):
        for name in dirs + names:
            p = os.path.join(top, name)
            if not os.path.islink(p):
                os.chmod(p, (0o777 if name in dirs else 0o666) & ~mask)


def sync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first (their entries name the files)."""
    for top, _dirs, names in os.walk(root, topdown=False):
        for name in names:
            p = os.path.join(top, name)
            if not os.path.islink(p):
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(Path(top))


class AtomicDir:
    """A directory built under a temporary sibling (`.tmp`, temp_sibling's name) and renamed into place
    whole by `commit`, so `path` is absent, the old one or the new one, never a part. Use as a context
    manager (commit on success, abort on an exception) or call commit/abort. `replace`: an existing
    `path` is replaced (moved aside, then deleted once the new one stands); otherwise commit refuses it
    with FileExistsError. `tmp`: a fixed temporary name instead of the rule's, only for a store whose
    leftovers are already known by that name (checkpoints' step-N.tmp); a stale one is removed first.
    With the rule's name, what killed writers of `path` left is removed first (remove_stale_temps)."""

    def __init__(self, path: str | os.PathLike, *, replace: bool = False, tmp: Path | None = None):
        self.path, self.replace = Path(path).absolute(), replace
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # a killed writer's: the caller holds the only right to write
        else:
            remove_stale_temps(self.path)
        self.tmp = Path(tmp) if tmp is not None else temp_sibling(self.path)
        _claim(self.tmp)  # before it exists: no moment where it exists and nothing would remove it
        self.tmp.mkdir()

    def __enter__(self) -> "AtomicDir":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def commit(self, synced: bool = False) -> Path:
        """fsync the temporary's files and directories (skipped when `synced`: the caller did it through
        the handles it held), rename it into place, fsync the parent. Returns `path`."""
        umask_modes(self.tmp)
        if not synced:
            sync_tree(self.tmp)
        old = None
        if self.path.exists():
            if not self.replace:
                self.abort()
                raise FileExistsError(f"{self.path} already exists (it appeared while it was being written)")
            old = temp_sibling(self.path, "old")  # rename cannot replace a non-empty directory
            os.replace(self.path, old)
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            if old is not None:
                os.replace(old, self.path)  # the old one back under its name
            raise
        _release(self.tmp)
        fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        _release(self.tmp)


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes, read in chunks: the one file digest (checkpoint files, a
    regeneration's input)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-Infinity) replaced by None, recursively through dicts,
    lists and tuples: Python's json writes them as bare NaN/Infinity, which is not JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any, indent: int | None = 1) -> None:
    """Write `obj` as valid JSON (non-finite floats become null), atomically: a temporary sibling is
    written and fsynced, then renamed over `path`, so a reader sees the old file or the new one."""
    atomic_write(path, json.dumps(json_safe(obj), indent=indent, allow_nan=False) + "\n")


class OutputPathError(ValueError):
    """An output path that cannot be written. A ValueError, not an OSError, because it is bad input (a
    flag or key naming a missing or read-only place): callers map it to exit 2 with the rest of their
    input errors, before any work is done, instead of failing at the end of a run."""


def check_output_path(path: str | os.PathLike, what: str, make_parents: bool = False) -> Path:
    """`path` as a Path, once it is known that a file can be created there; else OutputPathError naming
    `what` (the flag or key that gave it) and the path. Call it at start-up for every output, so a long
    evaluation or benchmark does not end in a traceback. Writability is probed by creating and removing a
    temporary file in the directory: permission bits say nothing about read-only mounts, an immutable
    (chattr +i) directory or root's bypass of them. `make_parents`: a missing directory is created
    (check_output_dir) instead of refused. A path that is not a regular file (/dev/null, a FIFO) is
    checked as it is: atomic_write writes through it, so neither its folder nor a rename matters."""
    path = Path(path)
    if is_special(path):
        return check_special(path, what)
    parent = path.parent
    if make_parents and not parent.exists():
        check_output_dir(parent, what)
    if path.is_dir():
        raise OutputPathError(f"{what} {path}: is a directory, not a file")
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise OutputPathError(f"{what} {path}: its directory {parent} {why}")
    try:
        probe_dir(parent)
    except OSError as exc:
        raise OutputPathError(f"{what} {path}: cannot write in {parent}: {exc.strerror or exc}") from exc
    try:
        if path.exists():
            # opening for append changes neither contents nor mtime, yet fails on a read-only or immutable file
            open(path, "ab").close()
    except OSError as exc:
        raise OutputPathError(f"{what} {path}: cannot overwrite it: {exc.strerror or exc}") from exc
    return path


def check_special(path: Path, what: str) -> Path:
    """`path`, a device or FIFO, once it opens for writing; else OutputPathError. Non-blocking, so a FIFO
    with no reader yet does not hang the start-up check (ENXIO says only that none is there yet: the
    write waits for one, as writing to a pipe does)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            raise OutputPathError(f"{what} {path}: cannot write to it: {exc.strerror or exc}") from exc
    return path


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """`path` as a Path, created (with its parents) if missing, once a file can be written in it; else
    OutputPathError naming `what` and the path: the start-of-run check for an output folder."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"{what} {path}: cannot create it: {exc.strerror or exc}") from exc
    try:
        probe_dir(path)
    except OSError as exc:
        raise OutputPathError(f"{what} {path}: cannot write in it: {exc.strerror or exc}") from exc
    return path


def probe_dir(d: Path) -> None:
    """Create, write, fsync and remove a temporary file in `d`; the OSError when that fails (read-only,
    immutable, no permission, a full disk)."""
    fd, probe = tempfile.mkstemp(dir=d, prefix=".write-probe-")
    try:
        os.write(fd, b"ok\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)
