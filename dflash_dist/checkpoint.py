"""Atomic training-state checkpoints, named by role (the drafter's state; targets are stateless).

Layout: RUN_DIR/checkpoints/step-00000123/drafter.pt. A checkpoint is written under a temporary name
and renamed into place, so a crash during a save leaves only complete checkpoints under step-*.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
STATE_FILE = "drafter.pt"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step-{step:08d}"


def save_checkpoint(run_dir: Path, step: int, state: dict) -> Path:
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / STATE_FILE)
    with open(tmp / STATE_FILE, "rb") as f:
        os.fsync(f.fileno())
    if final.exists():  # the same step saved again (e.g. final == periodic): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    log.info("saved checkpoint %s", final)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary names are ignored)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if not p.name.endswith(".tmp") and (p / STATE_FILE).is_file())


def load_checkpoint(path: Path) -> dict:
    path = Path(path)
    f = path / STATE_FILE if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"checkpoint {f} does not exist")
    return torch.load(f, map_location="cpu", weights_only=False)
