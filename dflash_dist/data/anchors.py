"""The anchor rule, stated once: which positions of a sample may anchor a block, and how many a sample
gives. A block anchored at position p drafts p + 1, p + 2, ...; it trains only if p + 1 is supervised, so
the candidates are the p with loss_mask[p + 1] (p + 1 < length), every supervised token's predecessor:
every supervised token but a supervised first one. A block may run past the sample's end (its slots there
carry no label). Each sequence gives min(candidates, objective.num_anchors) anchors, drawn at random
(`training.objective.draw_anchors`); the plan, the dataset's counts and the forecast count with these.
It holds for every variant's layout: DSpark's anchor-as-first slot 0 drafts p + 1 itself (slot k drafts
p + k + 1, `training.objective.block_labels`), so its anchors need the same supervised next token. A sample cut by plan.long_samples=truncate is a
shorter sample to this rule: its candidates are those of its kept tokens, and a block's slots past the
cut carry no label, as past an end (plan/long_samples.py says why not the whole block before the cut)."""
from __future__ import annotations

import numpy as np
import torch


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """The candidate anchor positions (sorted) of one sequence's loss mask (its length,)."""
    return torch.nonzero(loss_mask[1:]).squeeze(1)


def count_anchorable(num_supervised: np.ndarray, first_supervised: np.ndarray) -> np.ndarray:
    """Candidates per sample from its supervised count and whether its first token is supervised."""
    return np.asarray(num_supervised, dtype=np.int64) - np.asarray(first_supervised, dtype=np.int64)


def tail_anchorable(lengths: np.ndarray, supervised: np.ndarray) -> np.ndarray:
    """Candidates per sample whose supervised tokens are its tail (a chat sample's response): the rule
    without a loss mask at hand (the forecast's)."""
    return np.clip(np.minimum(supervised, lengths - 1), 0, None)


def anchors_per_sample(anchorable: np.ndarray, num_anchors: int) -> np.ndarray:
    """Anchors a sample contributes: its candidates, capped per sequence, exactly what `draw_anchors` draws."""
    return np.minimum(anchorable, num_anchors)
