"""The token dataset: one flat token array, sample offsets and a loss mask (in memory or memory-mapped)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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

    def num_anchorable(self, block_size: int) -> np.ndarray:
        """Anchor positions per sample (int64) for blocks of `block_size`: positions p with a supervised
        next token (loss_mask[p + 1]) and the whole block inside the sample (p + block_size <= length),
        the candidates `objective.draw_anchors` picks from. 0 means no batch may hold the sample alone.
        Cached per block size."""
        cache = self.__dict__.setdefault("_anchorable", {})  # frozen dataclass: bypass __setattr__
        if block_size not in cache:
            if block_size < 1:
                raise ValueError(f"block_size must be >= 1, got {block_size}")
            start, lengths = self.offsets[:-1], self.lengths
            # Candidates' next tokens q = p + 1 lie in [1, length - block_size + 1], within the sample.
            stop = np.minimum(lengths - block_size + 2, lengths)
            bounds = np.empty(2 * len(self), dtype=np.int64)  # [start_0 + 1, start_0 + stop_0, start_1 + 1, ...]
            bounds[0::2] = start + 1
            bounds[1::2] = start + np.maximum(stop, 1)
            bounds = np.minimum(bounds, len(self.loss_mask))  # an empty last sample points past the end
            at = _mask_prefix(self.loss_mask, bounds)
            cache[block_size] = np.where(lengths >= block_size, at[1::2] - at[0::2], 0)
        return cache[block_size]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]


def _mask_prefix(loss_mask: np.ndarray, positions: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
    """Supervised tokens before each of `positions` (sorted, within [0, len(loss_mask)]), counted chunk by
    chunk: an int32 running sum of at most `chunk` tokens at a time, whatever the dataset size."""
    out = np.zeros(len(positions), dtype=np.int64)
    running, n = 0, len(loss_mask)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        c = np.zeros(b - a + 1, dtype=np.int32)
        np.cumsum(loss_mask[a:b], out=c[1:])
        lo, hi = np.searchsorted(positions, [a, b], side="right")  # a < position <= b
        out[lo:hi] = c[positions[lo:hi] - a].astype(np.int64) + running
        running += int(c[-1])
    return out


def preparation_skips(ds: TokenDataset) -> dict:
    """Samples the preparation step left out, by reason (a prepared dataset's meta.json records them)."""
    return dict(getattr(ds, "meta", {}).get("skipped", {}) or {})
