"""Durable writes: what atomic writers (checkpoints, datasets, exports, summaries) need from the filesystem."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Persist a directory entry (a rename into `path`), not only the files' contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    path = Path(path)
    text = json.dumps(json_safe(obj), indent=indent, allow_nan=False) + "\n"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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
    (check_output_dir) instead of refused."""
    path = Path(path)
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
