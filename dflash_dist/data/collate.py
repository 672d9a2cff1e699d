"""Packing samples into one padding-free token stream with cumulative sequence lengths."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_dist.data.dataset import TokenDataset


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (N,) int64
    loss_mask: torch.Tensor  # (N,) bool
    cu_seqlens: torch.Tensor  # (S+1,) int64, starts at 0, ends at N

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def position_ids(self) -> torch.Tensor:
        return position_ids(self.cu_seqlens)

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device), self.loss_mask.to(device), self.cu_seqlens.to(device))


def position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """0..len-1 for every sequence of the packed stream."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    n = int(cu_seqlens[-1])
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=n)
    return torch.arange(n, device=cu_seqlens.device) - starts


def collate(ds: TokenDataset, indices: np.ndarray) -> PackedBatch:
    parts = [ds.sample(int(i)) for i in indices]
    ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
    mask = np.concatenate([p[1] for p in parts]).astype(bool)
    cu = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p[0]) for p in parts], out=cu[1:])
    return PackedBatch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(cu))


def warm_up_batch(block_size: int, device) -> PackedBatch:
    """A small fixed packed batch for warm-ups: two all-supervised sequences, each long enough for a
    block (so every code path of a real batch runs: packing, context, anchors in two sequences)."""
    lens = [block_size + 3, 2 * block_size + 1]
    ids = torch.zeros(sum(lens), dtype=torch.long, device=device)
    cu = torch.tensor([0, lens[0], sum(lens)], device=device)
    return PackedBatch(ids, torch.ones_like(ids, dtype=torch.bool), cu)
