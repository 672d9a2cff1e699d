"""The run's random streams: each a torch generator seeded by a hash of its keys, e.g. (seed, epoch) for
an epoch's shuffle and (seed, epoch, batch) for a batch's anchors, so no two streams share a seed and any
rank can recreate any stream (resume, another layout) without replaying the others."""
from __future__ import annotations

import numpy as np
import torch


def seeded_generator(*keys: int) -> torch.Generator:
    seed = int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(seed)
