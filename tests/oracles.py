"""The tests' oracles: plain, unchunked references that production code is held to and never carries."""
from __future__ import annotations

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
