"""One optimizer step of the drafters, in the order the drafter role calls it:

  step_gradients  this drafter's batch (`drafter_step`: forward and backward of the loss in anchor chunks,
                  the last chunk's backward reducing the gradients over the drafters: DDP or FSDP2), or a
                  tail step's zero-weight step
  reduce_stats    the step's loss, weight and block sums and metrics, summed over the drafters
  optimizer_step  `normalise` (the one division of the reduced gradient), `clip_and_step`

What a step needs is two values: the batch (`StepBatch`: the packed batch, its target features and labels,
its anchors) and the run's frozen `StepSettings`, built by `step_settings` from the config (its objective, its variant options) and the
built spec, the same way by the run, its dummy step and every benchmark. The variant (`spec.family`,
models/variants) adds its term to each anchor chunk's unary loss; the step never branches on its name.

Memory follows the anchor chunk, not the batch. The fused context (`fc` + `hidden_norm` over the batch's
features) is computed once; its output is detached into a leaf that every anchor chunk reads, so each
chunk's draft layers and loss are backwarded as soon as they are computed (their activations freed), the
context's gradient accumulates in the leaf, and the last chunk's backward takes it through `fc`. With
`batch_mean` each chunk's loss is divided by the weight sum of the WHOLE batch, so the chunks add up to
exactly the unchunked loss and gradient; without it the gradient is that of the summed weighted loss, which
`normalise` divides by the whole optimizer step's weight sum (its block count under D-PACE) once it is known
(`objective.loss_norm=step`). The LM head and cross-entropy run `loss_rows` rows at a time (`objective.head_loss`).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from dflash_dist.config import Config
from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec, anchor_seq_starts
from dflash_dist.models.variants import LossChunk, RunProgress, options_for
from dflash_dist.parallel.sharding import DrafterSharding, total_norm
from dflash_dist.parallel.transport import TargetLabels
from dflash_dist.training.objective import (
    FullTarget,
    StepMetrics,
    argmax_block_labels,
    block_labels,
    head_loss,
    label_positions,
    loss_denominator,
    no_head_loss,
    soft_block_targets,
)
from dflash_dist.training.stats import Diverged, StepStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSettings:
    """Everything of the objective a step reads, fixed for a run."""
    block_size: int  # the spec's
    gamma: float  # the position decay exp(-(k-1)/gamma), DSpark's exp(-k/gamma) (unused under D-PACE)
    anchor_chunk: int  # anchors per forward/backward (0: all at once)
    loss_rows: int  # LM-head rows per chunk of the loss
    batch_mean: bool  # divide by the batch's own weight sum (objective.loss_norm=batch); else the caller does
    dpace_alpha: float | None  # D-PACE's smoothing (objective.position_weights=dpace), None: the gamma decay
    autocast_dtype: torch.dtype | None  # the draft layers' compute dtype under autocast (bf16 on CUDA)
    variant_options: Any  # the variant's Options value (models/variants/<name>/options.py), its loss knobs among them
    # objective.labels=target_full: (KL weight, L1 weight) of the loss against the target's whole
    # distribution (`objective.FullTarget`); None: the labels' hard or top-k cross-entropy.
    full: tuple[float, float] | None = None

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


def drafter_autocast(device: torch.device) -> torch.dtype | None:
    """The run's choice: the drafter trains in float32, its layers under bf16 autocast on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else None


def step_settings(cfg: Config, spec: DraftSpec, autocast_dtype: torch.dtype | None = None) -> StepSettings:
    """The one constructor of step settings (the run's, its dummy step's and every benchmark's), from the
    config's objective and the built spec's variant's options (the config's `variant` section);
    `autocast_dtype`: `drafter_autocast(device)` in a run, a benchmark's own choice otherwise."""
    objective = cfg.objective
    if objective.block_size != spec.block_size:
        raise ValueError(f"objective.block_size {objective.block_size} differs from the built spec's {spec.block_size}")
    dpace = objective.position_weights == "dpace"
    full = objective.labels == "target_full"
    # the registry's rule refuses it in a loaded config; a benchmark's or a test's settings meet it here
    if objective.labels not in spec.family.labels:
        raise ValueError(f"objective.labels={objective.labels}: variant {spec.family.name!r} trains on "
                         f"{' or '.join(spec.family.labels)} only (Variant.labels)")
    return StepSettings(
        block_size=spec.block_size, gamma=spec.family.gamma(objective), anchor_chunk=objective.anchor_chunk,
        loss_rows=objective.loss_rows, batch_mean=objective.loss_norm != "step",
        dpace_alpha=objective.dpace_alpha if dpace else None,
        autocast_dtype=autocast_dtype,
        variant_options=options_for(spec.family, cfg.variant),
        full=(objective.distill_kl_weight, objective.distill_l1_weight) if full else None)


@dataclass
class StepBatch:
    """A packed batch as the step trains on it: its target features (N, n_layers * H), the target's
    labels (distillation; None: the data's), its anchors (packed indices) with their offsets per sequence,
    and where the step stands in its run (a variant's schedule reads it: Domino's lambda; the run passes
    its step and exact total, a benchmark's lone step the default, which costs the same)."""
    data: PackedBatch
    features: torch.Tensor
    target: TargetLabels | None
    anchors: torch.Tensor
    anchor_cu: torch.Tensor
    progress: RunProgress = RunProgress()

def batch_targets(batch: PackedBatch, target: TargetLabels | None, anchors, anchor_cu, block_size: int,
                  gamma: float, dpace: bool = False, variant=None):
    """(labels (A, B), weights (A, B), soft (probs, ids) or None) for the objective's label kind. With
    `dpace` the weights are 1 on every trained slot: D-PACE's, computed with the loss, replace the decay.
    `variant`: its declared block layout (`Variant.layout`, block_labels' keywords); None: DFlash's."""
    layout = {} if variant is None else asdict(variant.layout)
    labels, weights = block_labels(batch.input_ids, batch.loss_mask, batch.cu_seqlens, anchors, anchor_cu,
                                   block_size, gamma, **layout)
    if dpace:
        weights = (weights > 0).float()
    if target is None:
        return labels, weights, None
    if target.values is None:
        return argmax_block_labels(target.ids[:, 0], labels, anchors), weights, None
    probs, ids, top1 = soft_block_targets(target.values, target.ids, labels, anchors)
    return top1, weights, (probs, ids)


_SUMMED = ("loss_sum", "weight_sum", "correct", "valid", "accept_sum", "num_blocks")


def merge_metrics(parts: list[StepMetrics]) -> StepMetrics:
    """The anchor chunks' metrics summed: the fixed fields and the variant's declared sums alike."""
    return replace(parts[0], **{k: sum(getattr(m, k) for m in parts) for k in _SUMMED},
                   sums={k: sum(m.sums[k] for m in parts) for k in parts[0].sums})


def final_state_targets(model: DFlashDrafter, features: torch.Tensor, anchors: torch.Tensor, num_tokens: int):
    """objective.labels=target_full: (the target's final state, the features' last H columns as
    `sends_final_hidden` sends them; each block slot's position in it (`label_positions`))."""
    H = model.lm_head.weight.shape[1]
    if features.shape[1] != (len(model.spec.target_layer_ids) + 1) * H:
        raise ValueError("objective.labels=target_full: the features must end with the target's final hidden "
                         "state (parallel/transport.py sends_final_hidden)")
    positions = label_positions(anchors, model.spec.block_size, num_tokens, model.variant.layout.anchor_drafts)
    return features[:, -H:], positions


def drafter_step(model: DFlashDrafter, batch: StepBatch, settings: StepSettings, *, scale: float = 1.0,
                 sharding: DrafterSharding | None = None) -> StepMetrics:
    """Forward + backward of one batch; gradients accumulate in the parameters' .grad: those of
    `scale` x the batch's weighted loss, its mean (sum / `loss_denominator`: the batch's weight sum, or
    its anchors under D-PACE) with `settings.batch_mean`, else its sum. With the drafters' `sharding`
    each chunk's draft layers run through its module (DDP's wrapper: its reducer is prepared in forward)
    and its `before_last_chunk()` runs before the last chunk, whose backward reduces the gradients."""
    o, data, variant = settings, batch.data, model.variant
    forward = model if sharding is None else sharding.module
    A = batch.anchors.numel()
    if A == 0:
        raise ValueError("a batch without any anchor reached the drafter step (the plan must skip such samples)")
    # Host copies bound each chunk's context rows (anchors are best drawn on the host: no sync then).
    host_anchors = batch.anchors.cpu()
    host_starts = anchor_seq_starts(data.cu_seqlens.cpu(), batch.anchor_cu.cpu(), A)
    dev = data.input_ids.device
    anchors, anchor_cu = batch.anchors.to(dev), batch.anchor_cu.to(dev)
    dpace = o.dpace_alpha is not None
    labels, weights, soft = batch_targets(data, batch.target, anchors, anchor_cu, o.block_size, o.gamma, dpace,
                                          variant)
    starts = host_starts.to(dev)
    full = None if o.full is None else final_state_targets(model, batch.features, anchors, data.num_tokens)
    norm = scale / loss_denominator(dpace, weights.sum().clamp(min=1e-9), A) if o.batch_mean else scale
    head, top_k = model.lm_head.weight, variant.loss_top_k(model.spec)
    autocast = o.autocast(dev)
    with autocast:
        ctx = model.context(batch.features)
    leaf = ctx.detach().requires_grad_()  # the chunks before the last accumulate the context's gradient here
    chunk = o.anchor_chunk if 0 < o.anchor_chunk < A else A
    bounds = list(range(0, A, chunk))
    parts = []
    for a in bounds:
        sl, last = slice(a, a + chunk), a == bounds[-1]
        if last and sharding is not None:
            sharding.before_last_chunk()
        # The chunk's blocks see context rows [its first sequence's start, its last anchor) only: anchors
        # are in packed order, so that range is all the draft layers need to project to keys and values.
        lo = int(host_starts[a])
        hi = max(int(host_anchors[min(a + chunk, A) - 1]), lo + 1)
        with autocast:
            # The last chunk reads the context itself: one backward then covers it, the accumulated
            # gradient of the earlier chunks and fc + hidden_norm.
            hidden = forward((ctx if last else leaf)[lo:hi], data.input_ids, data.position_ids, anchors[sl],
                             starts[sl], offset=lo)
        chunk_soft = None if soft is None else (soft[0][sl], soft[1][sl])
        chunk_full = None if full is None else FullTarget(full[0], full[1][sl], *o.full)
        # A variant's candidates (the head's top-K) come off the loss's own logits: no second head pass.
        # target_full: the variant's term reads the target's top-1 (as target_soft's), which the loss computed
        # (`HeadLoss.labels`); a whole-loss term (Domino) gets the data's labels (the trained slots) and
        # computes the target's itself.
        if variant.needs.head_loss:
            loss_sum, m, top, chunk_labels = head_loss(hidden.to(head.dtype), head, labels[sl], weights[sl],
                                                       chunk_soft, rows=o.loss_rows, dpace_alpha=o.dpace_alpha,
                                                       top_k=top_k, full=chunk_full)
        else:  # the variant's term is the whole loss (DSpark: its slot logits carry a bias of their own)
            (loss_sum, m), top, chunk_labels = no_head_loss(labels[sl], weights[sl]), None, labels[sl]
        terms = LossChunk(data.input_ids, anchors[sl], chunk_labels, weights[sl], o.loss_rows, batch.features,
                          batch.progress, chunk_full)
        loss_sum, m = variant.loss_term(model, hidden, terms, loss_sum, m, top, o.variant_options)
        if not last:
            (loss_sum * norm).backward()
        elif leaf.grad is None:
            (loss_sum * norm).backward()
        else:
            torch.autograd.backward([loss_sum * norm, ctx], [None, leaf.grad])
        parts.append(m)
    return merge_metrics(parts)


# -- one optimizer step of the drafters: gradients, reduce, normalise, clip and step -----------------

def step_gradients(sharding: DrafterSharding, batch: StepBatch | None, settings: StepSettings,
                   idle: Callable[[], StepBatch]) -> StepMetrics | None:
    """This drafter's part of one optimizer step's gradient, reduced over the drafters by the last anchor
    chunk's backward. Both reductions (DDP's all-reduce, FSDP's reduce-scatter) average over the
    drafters, so each batch's loss is scaled by their number: the reduced gradient is the step's sum,
    which `normalise` divides. In a tail step without a batch (None) the drafter still joins the
    reduction, with the zero-weight step on `idle()` (a small fixed batch, one anchor a chunk)."""
    sharding.begin_step()
    if batch is None:
        drafter_step(sharding.model, idle(), replace(settings, anchor_chunk=1), scale=0.0, sharding=sharding)
        return None
    return drafter_step(sharding.model, batch, settings, scale=float(sharding.size), sharding=sharding)


def reduce_stats(stats: StepStats, group, device: torch.device) -> StepStats:
    """The step's stats summed over the drafters (one all-reduce): every drafter then holds the step's
    totals, the loss, the weight sum and the blocks `normalise` divides by among them."""
    t = stats.pack(device)
    dist.all_reduce(t, group=group)
    return StepStats.unpack(t, stats.block_size, stats.figures)


def normalise(params, settings: StepSettings, total: StepStats, real: int) -> None:
    """The one normalisation of a step's reduced (summed) gradient, the same on every drafter.
    objective.loss_norm=step: divided by the step's total weight (its blocks under D-PACE,
    `loss_denominator`), so every trained (token, slot) of the step counts alike. loss_norm=batch: each
    batch's loss was already its own mean (drafter_step); the sum is divided by the step's `real`
    batches (an idle drafter's zero-weight step adds nothing)."""
    if settings.batch_mean:
        if real > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(real)
        return
    denom = loss_denominator(settings.dpace_alpha is not None, total.weight_sum, total.blocks)
    if denom > 0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / denom)


def clip_and_step(state, params, cfg: Config, loss_sum: float, keep_grads: bool = False) -> float:
    """Clip and step `state`'s optimizer (training.state.TrainState), unless the step's loss sum or
    (reduced, so on every drafter identical) gradient norm is not finite: then the step is skipped alike
    everywhere, and too many such steps end the run (`Diverged`). Returns the gradient norm.
    `keep_grads`: zeroed in place (DDP's bucket views), else freed."""
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    norm = total_norm(torch.nn.utils.clip_grad_norm_(params, clip))
    t = state.totals
    t.steps += 1
    if math.isfinite(norm) and math.isfinite(loss_sum):
        state.optimizer.step()
        t.last_finite_step = t.steps  # checkpoints are written only after such a step
    else:
        t.skipped_steps += 1
        log.warning("step %d skipped: loss sum %s, gradient norm %s (%d of at most %d non-finite steps)",
                    t.steps, loss_sum, norm, t.skipped_steps, cfg.train.max_nonfinite_steps)
        if t.skipped_steps >= cfg.train.max_nonfinite_steps:
            raise Diverged(f"training diverged: {t.skipped_steps} steps with a non-finite loss or "
                           f"gradient norm (train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); lower "
                           f"optim.lr (now {cfg.optim.lr}; a resume may change it) or check the data; no "
                           "checkpoint or export was written from the diverged weights")
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=not keep_grads)
    return norm


def optimizer_step(state, sharding: DrafterSharding, settings: StepSettings, total: StepStats, real: int,
                   cfg: Config) -> float:
    """After `step_gradients` and `reduce_stats`: normalise, clip and step; the gradient norm."""
    normalise(sharding.params, settings, total, real)
    return clip_and_step(state, sharding.params, cfg, total.loss_sum, keep_grads=sharding.keep_grads)
