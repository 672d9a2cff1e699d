"""Domino's objective, the whole loss of an anchor chunk (the plain head's pass is not run:
`Needs.head_loss` False), and the schedule of its mixing weight lambda.

At each trained slot k (anchor-as-first labels, per-slot mask, weights w_k = exp(-k/gamma) from the step),
with base logits b_k = lm_head(h_k) and final logits z_k = b_k + W2 . SiLU(W1 . [h_k; s_k]) (z_0 = b_0;
`head.py`, s_k the GRU state over the data tokens before slot k's):

  w_k * ( (1 - lambda) * CE(z_k, label_k) + lambda * CE(b_k, label_k) )

summed, not normalised (the step divides by the step's all-reduced weight sum like the unary loss).
lambda falls linearly from 1 to 0 over the first fraction f (`variant.lambda_fraction`) of the
run's optimizer steps: lambda(s) = max(0, 1 - s / max(1, floor(f * T))) at the step that follows s taken
steps of T, SpecForge's `linear_lambda_base` (specforge/training/strategies/base.py, lambda_start 1); with no
known total (T = 0: a benchmark's or a test's lone step) lambda is 0, as SpecForge's "no schedule horizon".
The run passes (s, T) in each `StepBatch.progress`; s is the checkpointed step count, so a resumed run
continues the schedule exactly.

Under objective.labels=target_full (`LossChunk.full`, the step's `objective.FullTarget`) each of the two
cross-entropies becomes the distillation of the target's whole next-token distribution,
D(z) = a * KL(p_t || softmax(z)) + b * ||softmax(z) - p_t||_1 (a, b = objective.distill_{kl,l1}_weight),
p_t = softmax(lm_head(last[anchor + k])) from the target's final-normed state (`label_positions`, anchor as
first), computed once per row chunk and shared by both terms:

  w_k * ( (1 - lambda) * D(z_k) + lambda * D(b_k) )

with the metrics counted against the target's top-1 (returned beside the loss, as `objective.head_loss`
returns it for the unary variants).

Memory: `rows` labelled rows at a time (the row loop of models/head_loss.py, which the unary loss and
DSpark's run too); each chunk's gradients (into h, the delta features a and W2) are computed in the
forward on two float32 (rows, V) buffers, the base logits' softmax and the final's, and only they are
kept (rows x H, rows x E, V x E). The GRU and W1 are small (rows x (H + G)) and left to autograd through
a. Under target_full a chunk holds four float32 (rows, V) buffers: the two logits' (each turned into its
term's gradient in place), p_t and one scratch (q - p_t and the L1 term's sign; the target's entropy
before that).
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch

from dflash_dist.models.head_loss import (
    Chunk,
    ChunkLoss,
    RowInputs,
    chunk_rows,
    l1_softmax_grad,
    rowdot,
    with_gradients,
)
from dflash_dist.models.variants.domino.head import delta_features, prefix_states
from dflash_dist.models.variants.dspark.loss import previous_tokens


def domino_lambda(step: int, total: int, fraction: float) -> float:
    """lambda at the optimizer step after `step` taken ones of a run of `total` (0: none known)."""
    if total <= 0:
        return 0.0
    return max(0.0, 1.0 - step / max(1, math.floor(fraction * total)))


class Distill(NamedTuple):
    """target_full's teacher at the loss's rows: D's weights and the target's final states."""
    last: torch.Tensor  # (n, H) the target's final state at each row's position, in the head's dtype
    kl_weight: float
    l1_weight: float


class _MixedRows(NamedTuple):
    """Domino's data at its n labelled rows, for `_ce_chunk` and `_distill_chunk`."""
    head: torch.Tensor  # (V, H) the frozen LM head
    w2: torch.Tensor  # (V, E) embed_proj's last weight (a shared input: its gradient sums over the rows)
    labels: torch.Tensor | None  # (n,) the data's (None under target_full)
    weights: torch.Tensor  # (n,) float32
    lam: float
    teacher: Distill | None


class MixedValues(NamedTuple):
    pred: torch.Tensor  # (n,) the final logits' argmax
    base: torch.Tensor  # (n,) the base logits' (the plain head's) argmax
    top1: torch.Tensor | None  # (n,) target_full: the target's top-1


def _logits(rows: _MixedRows, h: torch.Tensor, a: torch.Tensor):
    """(base logits b, final logits z = b + a . W2), float32 (r, V) each."""
    pb = (h @ rows.head.T).float()
    return pb, torch.addmm(pb, a, rows.w2.T)


def _backprop(rows: _MixedRows, g: torch.Tensor, gb: torch.Tensor, a: torch.Tensor):
    """(row gradients into h and a, W2's share) of the logit gradients g = d/d(delta), gb = d/db."""
    return (gb.to(rows.head.dtype) @ rows.head, g @ rows.w2), ((g.T, a),)


def _ce_chunk(rows: _MixedRows, chunk: Chunk) -> ChunkLoss:
    """One row chunk of sum_r w_r * ((1 - lam) * ce(b_r + a_r . W2) + lam * ce(b_r)), row inputs h and the
    delta features a. Gradients: d/db = w * ((1 - lam) * p + lam * p_b - onehot), d/d(delta) = w * (1 -
    lam) * (p - onehot), p and p_b the softmaxes of the final and the base logits (in their buffers)."""
    sl, lam = chunk.rows, rows.lam
    h, ak = chunk.inputs
    lab, w = rows.labels[sl, None], rows.weights[sl]
    pb, p = _logits(rows, h, ak)
    values = MixedValues(p.argmax(-1), pb.argmax(-1), None)
    ce = torch.zeros_like(w)
    for q, share in ((p, 1.0 - lam), (pb, lam)):
        at, top = q.gather(1, lab)[:, 0], q.max(-1).values
        q.sub_(top[:, None]).exp_()
        total = q.sum(-1)
        q.div_(total[:, None])  # the softmax, in place
        ce += share * (top + total.log() - at)
    loss = (w * ce).sum()
    if not chunk.need_grad:
        return ChunkLoss(loss, values)
    minus_one = torch.full_like(w, -1.0)[:, None]
    g = p.scatter_add_(1, lab, minus_one).mul_((w * (1.0 - lam))[:, None])  # d/d(delta)
    gb = pb.scatter_add_(1, lab, minus_one).mul_((w * lam)[:, None]).add_(g)  # d/db
    return ChunkLoss(loss, values, *_backprop(rows, g, gb, ak))


def _distill_in_place(z, p_t, neg_entropy, kl_w: float, l1_w: float, scratch, need_grad: bool) -> torch.Tensor:
    """D(z) per row, a * KL(p_t || q) + b * ||q - p_t||_1 with q = softmax(z), z (r, V) float32 logits;
    with `need_grad` z is left holding dD/dz = a (q - p_t) + b q (s - <q, s>), s = sign(q - p_t)
    (`l1_softmax_grad`; else garbage). KL is read as sum p_t log p_t - <p_t, log q>, the first sum
    (`neg_entropy`) computed once per chunk, so log p_t need not be kept beside p_t."""
    z.sub_(torch.logsumexp(z, -1, keepdim=True))  # log q
    term = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)
    if kl_w:
        term += kl_w * (neg_entropy - rowdot(p_t, z))
    q = z.exp_()
    if l1_w:
        d = torch.sub(q, p_t, out=scratch)
        term += l1_w * torch.linalg.vector_norm(d, 1, dim=-1)
        if need_grad:
            l1_softmax_grad(q, d.sign_(), l1_w)
    if need_grad:
        g = q.sub_(p_t).mul_(kl_w)
        if l1_w:
            g.add_(scratch)
    return term


def _distill_chunk(rows: _MixedRows, chunk: Chunk) -> ChunkLoss:
    """target_full: one row chunk of sum_r w_r * ((1 - lam) * D(b_r + a_r . W2) + lam * D(b_r)) (D:
    `_distill_in_place`), the chunk's p_t computed once from the target's final states and shared by both
    terms. Gradients: d/d(delta) = w (1 - lam) D'(z), d/db = that + w lam D'(b). A term whose share is 0
    (lambda 0 or 1, the schedule's ends) is not computed."""
    sl, lam, teach = chunk.rows, rows.lam, rows.teacher
    h, ak = chunk.inputs
    w = rows.weights[sl]
    t = (teach.last[sl] @ rows.head.T).float()  # the target's logits
    top1 = t.argmax(-1)
    t.sub_(torch.logsumexp(t, -1, keepdim=True))  # log p_t
    scratch = torch.exp(t)
    neg_entropy = rowdot(scratch, t)  # sum p_t log p_t (0 where p_t underflows: log p_t is finite)
    p_t = t.exp_()
    pb, z = _logits(rows, h, ak)
    values = MixedValues(z.argmax(-1), pb.argmax(-1), top1)
    term = torch.zeros_like(w)
    for buf, share in ((z, 1.0 - lam), (pb, lam)):
        if share:
            term += share * _distill_in_place(buf, p_t, neg_entropy, teach.kl_weight, teach.l1_weight, scratch,
                                              chunk.need_grad)
    loss = (w * term).sum()
    if not chunk.need_grad:
        return ChunkLoss(loss, values)
    g = z.mul_((w * (1.0 - lam))[:, None]) if lam < 1.0 else z.zero_()  # d/d(delta)
    gb = g if lam == 0.0 else pb.mul_((w * lam)[:, None]).add_(g)  # d/db
    return ChunkLoss(loss, values, *_backprop(rows, g, gb, ak))


def mixed_loss(h, a, w2, head_w, labels, wts, lam: float, rows: int, teacher: Distill | None = None):
    """(sum_r w_r * ((1 - lam) * L(final logits) + lam * L(base logits)), differentiable in h, a and W2;
    `MixedValues` of the n rows): L the cross-entropy on `labels`, or with `teacher` (target_full) the
    distillation D of the target's distribution; `rows` rows of logits at a time."""
    data = _MixedRows(head_w, w2, labels, wts, lam, teacher)
    inputs = RowInputs((h, a), (w2,))
    out = chunk_rows(partial(_ce_chunk if teacher is None else _distill_chunk, data), inputs, rows)
    return with_gradients(out, inputs), out.values


def domino_term(model, hidden: torch.Tensor, chunk, lam: float):
    """(sum of w * loss, differentiable; pred and base (A, B) the final and the base logits' argmax at
    labelled slots, -1 elsewhere; the labels the metrics count: the data's, or the target's top-1 at the
    labelled slots under target_full)."""
    head_w = model.lm_head.weight
    A, B, H = hidden.shape
    sel = torch.nonzero(chunk.labels.reshape(-1) >= 0).squeeze(1)
    # Teacher forcing: slot k's GRU state has consumed the data tokens at anchor .. anchor + k.
    states = prefix_states(model, previous_tokens(chunk.input_ids, chunk.anchors, B)).reshape(A * B, -1)[sel]
    h = hidden.reshape(A * B, H)[sel]
    drafts_delta = (sel % B != 0).float()[:, None]  # slot 0: the base logits alone (pure_draft_prefix_len 1)
    a = delta_features(model, h, states) * drafts_delta
    labels, wts = chunk.labels.reshape(-1)[sel], chunk.weights.reshape(-1)[sel].float()
    w2 = model.embed_proj[2].weight
    h = h.to(head_w.dtype)
    full = chunk.full
    teacher = None  # target_full: the target's final state at each selected row's position (anchor + k)
    if full is not None:
        last = full.last[full.pos.reshape(-1)[sel]].to(head_w.dtype)
        teacher = Distill(last, float(full.kl_weight), float(full.l1_weight))
    loss, vals = mixed_loss(h, a, w2, head_w, None if full else labels, wts, float(lam), chunk.rows, teacher)
    counted = chunk.labels
    if full is not None:
        counted = chunk.labels.clone()
        counted.view(-1)[sel] = vals.top1
    pred, base = (torch.full((A * B,), -1, dtype=torch.long, device=hidden.device) for _ in range(2))
    pred[sel], base[sel] = vals.pred, vals.base
    return loss, pred.view(A, B), base.view(A, B), counted
