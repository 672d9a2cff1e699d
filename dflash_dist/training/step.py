"""One drafter training step without the optimizer: forward and backward of the DFlash loss on a batch.

Memory follows the anchor chunk, not the batch. The fused context (`fc` + `hidden_norm` over the batch's
features) is computed once; its output is detached into a leaf that every anchor chunk reads, so each
chunk's draft layers and loss are backwarded as soon as they are computed (their activations freed), the
context's gradient accumulates in the leaf, and the last chunk's backward takes it through `fc`. With
`batch_mean` each chunk's loss is divided by the weight sum of the WHOLE batch, so the chunks add up to
exactly the unchunked loss and gradient; without it the gradient is that of the summed weighted loss, which
the caller divides by the whole optimizer step's weight sum (its block count under D-PACE) once it is known (`objective.loss_norm=step`). The LM head and cross-entropy run `loss_rows` rows at a time (`objective.lm_head_loss`).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.drafter import DFlashDrafter, anchor_seq_starts
from dflash_dist.training.objective import (StepMetrics, argmax_block_labels, block_labels, lm_head_loss,
                                   loss_denominator, soft_block_targets)
from dflash_dist.parallel.transport import TargetLabels
from dflash_dist.training.selector import SelectorMetrics, selector_term


def batch_targets(batch: PackedBatch, target: TargetLabels | None, anchors, anchor_cu, block_size: int,
                  gamma: float, dpace: bool = False):
    """(labels (A, B), weights (A, B), soft (probs, ids) or None) for the objective's label kind. With
    `dpace` the weights are 1 on every trained slot: D-PACE's, computed with the loss, replace the decay."""
    labels, weights = block_labels(batch.input_ids, batch.loss_mask, batch.cu_seqlens, anchors, anchor_cu,
                                   block_size, gamma)
    if dpace:
        weights = (weights > 0).float()
    if target is None:
        return labels, weights, None
    if target.values is None:
        return argmax_block_labels(target.ids[:, 0], labels, anchors), weights, None
    probs, ids, top1 = soft_block_targets(target.values, target.ids, labels, anchors)
    return top1, weights, (probs, ids)


_SUMMED = ("loss_sum", "weight_sum", "correct", "valid", "accept_sum", "num_blocks", "unary_correct",
           "unary_accept_sum", "selector_loss_sum", "topk_hits")


def merge_metrics(parts: list[StepMetrics]) -> StepMetrics:
    return replace(parts[0], **{k: sum(getattr(m, k) for m in parts) for k in _SUMMED
                                if getattr(parts[0], k) is not None})


def with_selector(m: StepMetrics, sm: SelectorMetrics, alpha: float) -> StepMetrics:
    """A DFlash 2 chunk's metrics: the loss includes alpha x the selector term; acc and acceptance follow
    the selector's walk, the unary head's kept beside them."""
    return replace(m, loss_sum=m.loss_sum + alpha * sm.loss_sum, correct=sm.correct, accept_sum=sm.accept_sum,
                   unary_correct=m.correct, unary_accept_sum=m.accept_sum, selector_loss_sum=sm.loss_sum,
                   topk_hits=sm.topk_hits)


def drafter_step(model: DFlashDrafter, batch: PackedBatch, features: torch.Tensor, target: TargetLabels | None,
                 anchors: torch.Tensor, anchor_cu: torch.Tensor, *, gamma: float, anchor_chunk: int = 0,
                 loss_rows: int = 8192, scale: float = 1.0, batch_mean: bool = True, autocast=contextlib.nullcontext(),
                 before_last_chunk=None, dpace_alpha: float | None = None, selector_weight: float = 1.0,
                 selector_detach: bool = False) -> StepMetrics:
    """Forward + backward of one batch; gradients accumulate in the parameters' .grad: those of
    `scale` x the batch's weighted loss, its mean (sum / `loss_denominator`: the batch's weight sum, or
    its anchors under D-PACE) with `batch_mean`, else its sum. `dpace_alpha`: D-PACE position weights
    (objective.position_weights=dpace) instead of the gamma decay. `before_last_chunk()` runs before the
    last chunk (FSDP: reduce its gradients in that backward). A DFlash 2 drafter adds `selector_weight` x
    the selector term (training/selector.py; `selector_detach`: none of its gradient into the backbone)."""
    A = anchors.numel()
    if A == 0:
        raise ValueError("a batch without any anchor reached the drafter step (the plan must skip such samples)")
    # Host copies bound each chunk's context rows (anchors are best drawn on the host: no sync then).
    host_anchors = anchors.cpu()
    host_starts = anchor_seq_starts(batch.cu_seqlens.cpu(), anchor_cu.cpu(), A)
    dev = batch.input_ids.device
    anchors, anchor_cu = anchors.to(dev), anchor_cu.to(dev)
    dpace = dpace_alpha is not None
    labels, weights, soft = batch_targets(batch, target, anchors, anchor_cu, model.spec.block_size, gamma, dpace)
    starts = host_starts.to(dev)
    positions = batch.position_ids
    norm = scale / loss_denominator(dpace, weights.sum().clamp(min=1e-9), A) if batch_mean else scale
    head, top_k = model.lm_head.weight, model.spec.selector_top_k if model.spec.dflash2 else 0  # DFlash 2's top-K
    with autocast:
        ctx = model.context(features)
    leaf = ctx.detach().requires_grad_()  # the chunks before the last accumulate the context's gradient here
    chunk = anchor_chunk if 0 < anchor_chunk < A else A
    bounds = list(range(0, A, chunk))
    parts = []
    for a in bounds:
        sl, last = slice(a, a + chunk), a == bounds[-1]
        if last and before_last_chunk is not None:
            before_last_chunk()
        # The chunk's blocks see context rows [its first sequence's start, its last anchor) only: anchors
        # are in packed order, so that range is all the draft layers need to project to keys and values.
        lo = int(host_starts[a])
        hi = max(int(host_anchors[min(a + chunk, A) - 1]), lo + 1)
        with autocast:
            # The last chunk reads the context itself: one backward then covers it, the accumulated
            # gradient of the earlier chunks and fc + hidden_norm.
            hidden = model.draft_hidden((ctx if last else leaf)[lo:hi], batch.input_ids, positions, anchors[sl],
                                        starts[sl], offset=lo)
        chunk_soft = None if soft is None else (soft[0][sl], soft[1][sl])
        # DFlash 2's candidates (the head's top-K) come off the loss's own logits: no second head pass.
        loss_sum, m, *top = lm_head_loss(hidden.to(head.dtype), head, labels[sl], weights[sl], chunk_soft,
                                         rows=loss_rows, dpace_alpha=dpace_alpha, top_k=top_k)
        if model.spec.dflash2:
            sel_sum, sm = selector_term(model, hidden, batch.input_ids, anchors[sl], labels[sl], weights[sl],
                                        top[0], detach=selector_detach, rows=loss_rows)
            loss_sum, m = loss_sum + selector_weight * sel_sum, with_selector(m, sm, selector_weight)
        if not last:
            (loss_sum * norm).backward()
        elif leaf.grad is None:
            (loss_sum * norm).backward()
        else:
            torch.autograd.backward([loss_sum * norm, ctx], [None, leaf.grad])
        parts.append(m)
    return merge_metrics(parts)
