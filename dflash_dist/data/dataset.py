"""The token dataset: one flat token array, sample offsets and a loss mask (in memory or memory-mapped)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dflash_dist.data.anchors import count_anchorable


@dataclass(frozen=True)
class TokenDataset:
    """Sample i is tokens[offsets[i]:offsets[i+1]], supervised where loss_mask is 1.

    The arrays may be np.memmap views of the on-disk format, so every rank of a node shares pages.
    """
    tokens: np.ndarray  # uint32 / int64, all samples concatenated
    offsets: np.ndarray  # int64, len = num_samples + 1, offsets[0] == 0
    loss_mask: np.ndarray  # uint8, same length as tokens
    vocab_size: int

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @cached_property
    def num_supervised(self) -> np.ndarray:
        """Supervised tokens per sample (int64), counted in chunks: no per-token temporary."""
        out = np.zeros(len(self), dtype=np.int64)
        nonempty = np.flatnonzero(self.lengths > 0)
        step = 1 << 20
        for i in range(0, len(nonempty), step):
            idx = nonempty[i:i + step]
            a, b = int(self.offsets[idx[0]]), int(self.offsets[idx[-1] + 1])
            out[idx] = np.add.reduceat(np.asarray(self.loss_mask[a:b], dtype=np.int64), self.offsets[idx] - a)
        return out

    @cached_property
    def num_anchorable(self) -> np.ndarray:
        """Anchor candidates per sample (int64), by the rule of `data.anchors`. 0 means nothing to train:
        no supervised token follows the sample's first."""
        lengths = self.lengths
        first = np.zeros(len(self), dtype=np.int64)
        nonempty = np.flatnonzero(lengths > 0)
        first[nonempty] = np.asarray(self.loss_mask[self.offsets[nonempty]], dtype=np.int64)
        return count_anchorable(self.num_supervised, first)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]


def preparation_skips(ds: TokenDataset) -> dict:
    """Samples the preparation step left out, by reason (a prepared dataset's meta.json records them)."""
    return dict(getattr(ds, "meta", {}).get("skipped", {}) or {})


def preparation_sources(ds: TokenDataset) -> list[dict]:
    """Per input source of `data.prepare` (its path, weight, lines, draws, samples, tokens, skips), as its
    meta.json records them; [] for a dataset prepared before mixtures or not prepared at all."""
    return list(getattr(ds, "meta", {}).get("sources", []) or [])
