"""The token dataset: one flat token array, sample offsets and a loss mask (in memory or memory-mapped)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    @property
    def num_supervised(self) -> np.ndarray:
        """Supervised tokens per sample (int64)."""
        csum = np.zeros(len(self.loss_mask) + 1, dtype=np.int64)
        np.cumsum(self.loss_mask, out=csum[1:])
        return csum[self.offsets[1:]] - csum[self.offsets[:-1]]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]
