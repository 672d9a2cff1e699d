"""Durable renames: what atomic writers (checkpoints, datasets, exports) need from the filesystem."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a directory entry (a rename into `path`), not only the files' contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
