"""Atomic training-state checkpoints, named by role, and the choice of where to resume.

Layout: RUN_DIR/checkpoints/step-00000123/{drafter.pt, meta.json}. drafter.pt holds the drafter's
weights, optimizer, scheduler, RNG and counters (only drafters have state: targets are frozen); meta.json
holds the cursor, the resolved config and the number of drafters, small enough for every rank (targets
included) to read before the run starts. A checkpoint is written under a temporary name and renamed
into place, so a crash during a save leaves the previous checkpoints intact and no partial one that
`resume=auto` could pick.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_dist.config import Config, ConfigError, to_dict
from dflash_dist.fsutil import fsync_dir

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
STATE_FILE = "drafter.pt"
META_FILE = "meta.json"

# Config sections/keys that change what is trained: a checkpoint that disagrees on any is refused.
TRAINING_KEYS = ("model", "objective", "plan", "data", "optim", "train.seed", "train.epochs")
NOT_TRAINING = ("model.target.dtype", "model.target.path")  # how the same weights are loaded


@dataclass(frozen=True)
class Cursor:
    epoch: int  # the epoch to continue
    step: int  # the next global step in it (batch step * num_drafters + drafter index)


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step-{step:08d}"


def save_checkpoint(run_dir: Path, step: int, state: dict, meta: dict, keep_last: int = 0,
                    _fail_after_state: bool = False) -> Path:
    """Write atomically; then delete all but the newest `keep_last` (0 = keep all)."""
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / STATE_FILE)
    if _fail_after_state:  # test hook: a crash between the two files
        raise RuntimeError("simulated crash during checkpoint save")
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    for f in (STATE_FILE, META_FILE):
        with open(tmp / f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # the same step saved again (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    log.info("saved checkpoint %s", final)
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary names and partial directories are ignored)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*")
                  if not p.name.endswith(".tmp") and (p / STATE_FILE).is_file() and (p / META_FILE).is_file())


def read_meta(path: Path) -> dict:
    f = Path(path) / META_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint {path}: cannot read {META_FILE}: {exc}") from exc


def load_state(path: Path) -> dict:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise ConfigError(f"checkpoint {path}: {STATE_FILE} is missing")
    return torch.load(f, map_location="cpu", weights_only=False)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    a, b = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if not any(key == t or key.startswith(t + ".") for t in TRAINING_KEYS) or key in NOT_TRAINING:
            continue
        if a.get(key) != b.get(key):
            diffs.append(f"{key}: checkpoint {a.get(key)!r}, now {b.get(key)!r}")
    return diffs


def check_plan(meta: dict, path: Path, digests: list[str]) -> None:
    """A checkpoint cut mid-epoch continues that epoch's plan at its cursor: the plan rebuilt now must be
    the one it was cut from, or the rest of the epoch would repeat some samples and skip others. Same
    config, another numpy or torch (whose shuffle streams carry no cross-version guarantee) could differ."""
    c, saved = meta["cursor"], meta.get("plan_digests")
    epoch = int(c["epoch"])
    if not saved or int(c["step"]) == 0 or epoch >= len(saved):
        return  # at an epoch boundary nothing of the old plan is reused (or a checkpoint from before this check)
    if saved[epoch] != digests[epoch]:
        raise ConfigError(f"checkpoint {path} was cut at epoch {epoch + 1} step {c['step']} of a plan with "
                          f"fingerprint {saved[epoch]}, but the same config now builds {digests[epoch]} (another "
                          "numpy or torch version?); resuming mid-epoch would repeat or skip samples. Resume "
                          "with the original environment, or from a checkpoint at an epoch boundary")


def resolve_resume(cfg: Config, num_drafters: int) -> tuple[Path | None, Cursor]:
    """Which checkpoint to continue from (train.resume = auto | none | PATH), validated against the
    current config. Every rank calls this before training, on the same (shared) run directory."""
    mode = cfg.train.resume
    if mode == "none":
        return None, Cursor(0, 0)
    if mode == "auto":
        found = list_checkpoints(Path(cfg.train.run_dir))
        if not found:
            return None, Cursor(0, 0)
        path = found[-1]
    else:
        path = Path(mode)
        if not (path / STATE_FILE).is_file() or not (path / META_FILE).is_file():
            raise ConfigError(f"config key 'train.resume': {mode} is not a complete checkpoint "
                              f"(needs {STATE_FILE} and {META_FILE})")
    meta = read_meta(path)
    diffs = config_differences(meta["config"], to_dict(cfg))
    if meta.get("num_drafters") != num_drafters:
        diffs.append(f"number of drafters: checkpoint {meta.get('num_drafters')}, now {num_drafters}")
    if diffs:
        raise ConfigError(f"checkpoint {path} was trained with another setup; refusing to resume:\n  "
                          + "\n  ".join(diffs))
    c = meta["cursor"]
    return path, Cursor(int(c["epoch"]), int(c["step"]))
