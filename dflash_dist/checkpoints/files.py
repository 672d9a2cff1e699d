"""Durable writes: what atomic writers (checkpoints, datasets, exports, summaries) need from the filesystem."""
from __future__ import annotations

import json
import math
import os
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
