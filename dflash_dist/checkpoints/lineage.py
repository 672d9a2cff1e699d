"""Which checkpoints a run directory continues from: its lineage across roll-backs, fresh starts,
requeues and divergences.

The checkpoints live in RUN_DIR/checkpoints/ and `train.resume=auto` takes the newest valid one there.
Every start that does not simply continue (`train.resume=none`, or `train.resume=PATH` naming a
checkpoint for the first time) first moves the checkpoints it abandons into
RUN_DIR/checkpoints/set-aside/<reason>-<UTC time>/ (nothing is deleted, and nothing there is ever
resumed or pruned) and appends the start to RUN_DIR/lineage.json. So:

  * after a roll-back to PATH, `auto` (a requeue, a restart) never takes the newer checkpoints the user
    rolled back from: they are set aside; until the rolled-back run writes a checkpoint of its own,
    `auto` resumes PATH itself (the origin recorded in lineage.json);
  * `train.resume=PATH` applies once: a later start with the same PATH (a requeued job whose command
    line still says it) continues the run, exactly as `auto` would, instead of rolling back again;
  * after `train.resume=none`, `auto` continues the new run, never the old one;
  * a run stopped for divergence sets aside the checkpoints whose weights led only to non-finite steps
    (reason `diverged`), so `auto` takes the newest checkpoint known to be good.

Rank 0 writes (holding the run lock, after every rank has chosen its checkpoint); every rank reads.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from dflash_dist.config import ConfigError
from dflash_dist.io.files import fsync_dir, write_json

log = logging.getLogger(__name__)

LINEAGE_FILE = "lineage.json"
SET_ASIDE_DIR = "set-aside"  # under RUN_DIR/checkpoints/


def starts(run_dir: Path) -> list[dict]:
    """The recorded starts of the run directory, oldest first ([] before the first recorded one)."""
    f = Path(run_dir) / LINEAGE_FILE
    if not f.is_file():
        return []
    try:
        recs = json.loads(f.read_text())["starts"]
        if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
            raise TypeError("'starts' is not a list of objects")
        return recs
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{f} is damaged ({type(exc).__name__}: {exc}); it records which checkpoints this run "
                          "continues: restore it, or name the checkpoint with train.resume=PATH") from exc


def origin(run_dir: Path) -> Path | None:
    """The checkpoint the run's current lineage started from (its latest roll-back), or None (a fresh start)."""
    recs = starts(run_dir)
    return Path(recs[-1]["from"]) if recs and recs[-1].get("from") else None


def applied(run_dir: Path, path: Path) -> bool:
    """`train.resume=path` already started the run's current lineage: a later start continues it."""
    o = origin(run_dir)
    return o is not None and o == Path(path).resolve()


def set_aside(ckpt_root: Path, victims: list[Path], reason: str) -> Path | None:
    """Move `victims` (checkpoint directories of `ckpt_root`) into set-aside/<reason>-<time>/; returns it."""
    if not victims:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = Path(ckpt_root) / SET_ASIDE_DIR / f"{reason}-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{reason}-{stamp}-{n}")
    dest.mkdir(parents=True)
    for v in victims:
        os.replace(v, dest / v.name)
    fsync_dir(dest)
    fsync_dir(ckpt_root)
    return dest


def record(run_dir: Path, mode: str, source: Path | None, step: int, aside: Path | None) -> None:
    """Append one lineage start (atomically: a reader sees the old file or the new one)."""
    recs = starts(run_dir) + [{"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "resume": mode,
                               "from": str(source) if source else None, "step": step,
                               "set_aside": str(aside) if aside else None}]
    write_json(Path(run_dir) / LINEAGE_FILE, {"starts": recs})
