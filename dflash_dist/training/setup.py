"""What every role receives (one value with the config, the process groups and the built parts), and
what it returns."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_dist.config import Config
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.models.drafter import DraftSpec
from dflash_dist.parallel.dist import DistContext
from dflash_dist.parallel.stop import StopFlag
from dflash_dist.plan.schedule import Cursor


@dataclass(frozen=True)
class RunSetup:
    cfg: Config
    ctx: DistContext
    target: Any  # TinyQwen3, the transformers adapter, or a head-only stand-in on drafters
    spec: DraftSpec
    dataset: TokenDataset
    epoch_counts: tuple[int, ...]  # batches of every epoch, counted by rank 0 at start
    cursor: Cursor  # where this run starts: (0, 0) or the resumed checkpoint's cursor
    resume_from: Path | None
    stop_flag: StopFlag
    plan_digests: tuple[str, ...] = ()  # rank 0: every epoch's plan fingerprint, kept with each checkpoint
    skipped: dict | None = None  # rank 0: samples every plan skips, by reason
    plan_facts: dict | None = None  # rank 0: long samples skipped or cut, and shares (plan.long_samples)

    def origin(self, epoch: int) -> int:
        """First batch of `epoch` this run trains."""
        return self.cursor.batch if epoch == self.cursor.epoch else 0


@dataclass(frozen=True)
class RoleResult:
    stopped: bool  # True: stopped on request before the end (state saved; resume me)
    cursor: Cursor  # where a resumed run continues
    stats: dict
