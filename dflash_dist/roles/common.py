"""What every role receives: one value holding the config, the process groups and the built parts."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from dflash_dist.config import Config
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.dist import DistContext
from dflash_dist.models.drafter import DraftSpec
from dflash_dist.plan import BatchPlan


@dataclass(frozen=True)
class RunSetup:
    cfg: Config
    ctx: DistContext
    target: Any  # TinyQwen3 or the transformers adapter: .capture, .embed_tokens, .lm_head
    spec: DraftSpec
    dataset: TokenDataset
    epoch_counts: tuple[int, ...]  # batches of every epoch, counted by rank 0 at start


def plan_digest(plan: BatchPlan) -> str:
    """Short fingerprint of a plan, logged by every rank so a disagreement is visible."""
    h = hashlib.sha1(plan.offsets.tobytes())
    h.update(plan.indices.tobytes())
    return h.hexdigest()[:12]
