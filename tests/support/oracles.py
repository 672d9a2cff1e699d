"""The tests' oracles: plain, unchunked references that production code is held to and never carries."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dflash_dist.models.variants import accepted_lengths
from dflash_dist.training.objective import StepMetrics


def dflash_loss(logits, labels, weights, soft=None):
    """Weighted cross-entropy normalised by the sum of weights, and the metrics of this batch.
    soft: optional (probs, ids) (A, B, k) from `soft_block_targets`; the cross-entropy is then against
    that distribution (-sum_i p_i log q(ids_i)), and `labels` (its top-1) serves only the metrics."""
    A, B, V = logits.shape
    if soft is None:
        ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1).clamp(min=0), reduction="none").view(A, B)
    else:
        probs, ids = soft
        logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids)
        ce = -(probs * logq).sum(-1)
    wsum = weights.sum()
    loss = (ce * weights).sum() / wsum.clamp(min=1e-9)
    with torch.no_grad():
        valid = labels >= 0
        hit = (logits.argmax(-1) == labels) & valid
        run = accepted_lengths(hit[:, 1:])
        m = StepMetrics(loss_sum=float((ce * weights).sum()), weight_sum=float(wsum),
                        correct=hit.sum(0).cpu(), valid=valid.sum(0).cpu(),
                        accept_sum=float(run.sum()), num_blocks=A)
    return loss, m


def full_distill_loss(logits, target_logits, labels, weights, kl_weight: float, l1_weight: float):
    """objective.labels=target_full over the whole (A, B, V) logits at once: sum over the trained slots
    (labels >= 0) of w * (kl_weight * KL(p_t || q) + l1_weight * ||q - p_t||_1), q = softmax(logits),
    p_t = softmax(target_logits), both from log_softmax in float32 (differentiable w.r.t. logits), and the
    metrics against the target's top-1 on those slots."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    l1 = (logq.exp() - p).abs().sum(-1)
    valid = labels >= 0
    w = torch.where(valid, weights, torch.zeros_like(weights))
    loss_sum = ((kl_weight * kl + l1_weight * l1) * w).sum()
    with torch.no_grad():
        top1 = torch.where(valid, target_logits.argmax(-1), labels)
        hit = (logits.argmax(-1) == top1) & valid
        m = StepMetrics(loss_sum=float(loss_sum), weight_sum=float(weights.sum()), correct=hit.sum(0).cpu(),
                        valid=valid.sum(0).cpu(), accept_sum=float(accepted_lengths(hit[:, 1:]).sum()),
                        num_blocks=logits.shape[0])
    return loss_sum, m, top1


class FeatureDrafter:
    """`evaluation.speculative`'s proposer for a module with the drafter's `block_logits` (an oracle):
    the raw feature rows of the whole prefix at every step, a zero row for the anchor (never attended)."""

    def __init__(self, drafter, capacity: int = 0):
        self.drafter, self.feats = drafter, None

    def add(self, feats: torch.Tensor) -> None:
        self.feats = feats if self.feats is None else torch.cat([self.feats, feats])

    def propose(self, seq: Sequence[int]) -> list[int]:
        return propose_with_logits(self.drafter, self.feats, seq)


@torch.no_grad()
def propose_with_logits(drafter, features: torch.Tensor, seq: Sequence[int]) -> list[int]:
    """`evaluation.reference`'s proposer for such a module: the argmax of its logits after the anchor."""
    anchor, dev = len(seq) - 1, features.device
    feats = torch.cat([features[:anchor], features.new_zeros(1, features.shape[1])])
    logits = drafter.block_logits(feats, torch.tensor(list(seq), dtype=torch.long, device=dev),
                     torch.tensor([0, anchor + 1], device=dev), torch.arange(anchor + 1, device=dev),
                     torch.tensor([anchor], device=dev), torch.tensor([0, 1], device=dev))
    return logits[0, 1:].argmax(-1).tolist()
