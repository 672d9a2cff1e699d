"""What every role receives: one value holding the config, the process groups and the built parts."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_dist.checkpoint import Cursor
from dflash_dist.config import Config
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.dist import DistContext
from dflash_dist.models.drafter import DraftSpec
from dflash_dist.plan import BatchPlan
from dflash_dist.stop import StopFlag


@dataclass(frozen=True)
class RunSetup:
    cfg: Config
    ctx: DistContext
    target: Any  # TinyQwen3 or the transformers adapter: .capture, .embed_tokens, .lm_head
    spec: DraftSpec
    dataset: TokenDataset
    epoch_counts: tuple[int, ...]  # batches of every epoch, counted by rank 0 at start
    cursor: Cursor  # where this run starts: (0, 0) or the resumed checkpoint's cursor
    resume_from: Path | None
    stop_flag: StopFlag
    plan_digests: tuple[str, ...] = ()  # rank 0: every epoch's plan fingerprint, kept with each checkpoint


@dataclass(frozen=True)
class RoleResult:
    stopped: bool  # True: stopped on request before the end (state saved; resume me)
    cursor: Cursor  # where a resumed run continues
    stats: dict


def plan_digest(plan: BatchPlan) -> str:
    """Short fingerprint of a plan, logged by every rank so a disagreement is visible."""
    h = hashlib.sha1(plan.offsets.tobytes())
    h.update(plan.indices.tobytes())
    return h.hexdigest()[:12]


def start_step(run: RunSetup, epoch: int) -> int:
    return run.cursor.step if epoch == run.cursor.epoch else 0
