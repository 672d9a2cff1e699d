"""The DFlash training objective: anchors, block labels, position-decayed loss, metrics.

Anchors of a sequence are drawn uniformly without replacement among positions p whose next token is
supervised and that leave room for a whole block inside the sequence (p + B - 1 < len). The draw uses a
generator seeded by (seed, epoch, batch) alone, so a batch seen again (after a resume) gets the same
anchors on any rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def anchor_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((((seed * 1_000_003) + epoch) * 1_000_003 + batch) % (2**63 - 1))
    return g


def draw_anchors(loss_mask, cu_seqlens, block_size: int, num_anchors: int, gen: torch.Generator):
    """Returns (anchors (A,) packed indices sorted, anchor_cu (S+1,)). All on CPU."""
    loss_mask, cu = loss_mask.cpu(), cu_seqlens.cpu().tolist()
    chosen, counts = [], []
    for s, e in zip(cu[:-1], cu[1:]):
        last = e - block_size  # room for the whole block: p + B - 1 <= e - 1
        if last < s:
            counts.append(0)
            continue
        cand = torch.nonzero(loss_mask[s + 1:last + 2]).squeeze(1) + s  # p with mask[p + 1]
        k = min(num_anchors, cand.numel())
        pick = cand[torch.randperm(cand.numel(), generator=gen)[:k]].sort().values
        chosen.append(pick)
        counts.append(k)
    anchors = torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long)
    anchor_cu = torch.zeros(len(counts) + 1, dtype=torch.long)
    anchor_cu[1:] = torch.tensor(counts, dtype=torch.long).cumsum(0)
    return anchors, anchor_cu


def block_labels(input_ids, loss_mask, cu_seqlens, anchors, anchor_cu, block_size: int, gamma: float):
    """labels (A, B) (-100 where untrained) and weights (A, B): exp(-(k-1)/gamma) for slot k >= 1 whose
    target anchor+k lies inside the anchor's sequence and the loss mask; 0 elsewhere and in slot 0."""
    dev = input_ids.device
    B = block_size
    seq_end = torch.repeat_interleave(cu_seqlens[1:], anchor_cu[1:] - anchor_cu[:-1])  # (A,)
    pos = anchors[:, None] + torch.arange(B, device=dev)  # (A, B)
    inside = pos < seq_end[:, None]
    pos_c = pos.clamp(max=input_ids.numel() - 1)
    valid = inside & loss_mask[pos_c]
    valid[:, 0] = False
    labels = torch.where(valid, input_ids[pos_c], torch.full_like(pos_c, -100))
    decay = torch.exp(-(torch.arange(B, device=dev, dtype=torch.float32) - 1) / gamma)
    weights = valid.float() * decay
    return labels, weights


@dataclass
class StepMetrics:
    loss_sum: float  # sum of w * ce
    weight_sum: float
    correct: torch.Tensor  # (B,) correct predictions per slot
    valid: torch.Tensor  # (B,) trained labels per slot
    accept_sum: float  # sum over blocks of the accepted prefix length (+1 bonus)
    num_blocks: int


def dflash_loss(logits, labels, weights):
    """Weighted cross-entropy normalised by the sum of weights, and the metrics of this batch."""
    A, B, V = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1).clamp(min=0), reduction="none").view(A, B)
    wsum = weights.sum()
    loss = (ce * weights).sum() / wsum.clamp(min=1e-9)
    with torch.no_grad():
        valid = labels >= 0
        hit = (logits.argmax(-1) == labels) & valid
        # Accepted prefix: consecutive hits from slot 1; an untrained slot ends the run.
        run = torch.cumprod(hit[:, 1:].long(), dim=1).sum(1).float() + 1.0
        m = StepMetrics(loss_sum=float((ce * weights).sum()), weight_sum=float(wsum),
                        correct=hit.sum(0).cpu(), valid=valid.sum(0).cpu(),
                        accept_sum=float(run.sum()), num_blocks=A)
    return loss, m
