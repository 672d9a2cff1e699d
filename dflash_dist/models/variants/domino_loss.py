"""Domino's objective, the whole loss of an anchor chunk (the plain head's pass is not run:
`Domino.unary_loss` is False), and the schedule of its mixing weight lambda.

At each trained slot k (anchor-as-first labels, per-slot mask, weights w_k = exp(-k/gamma) from the step),
with base logits b_k = lm_head(h_k) and final logits z_k = b_k + W2 . SiLU(W1 . [h_k; s_k]) (z_0 = b_0;
`domino_head.py`, s_k the GRU state over the data tokens before slot k's):

  w_k * ( (1 - lambda) * CE(z_k, label_k) + lambda * CE(b_k, label_k) )

summed, not normalised (the step divides by the step's all-reduced weight sum like the unary loss).
lambda falls linearly from 1 to 0 over the first fraction f (`objective.domino_lambda_fraction`) of the
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

with the metrics counted against the target's top-1 (written to `FullTarget.top1`, as `lm_head_loss` does
for the unary variants).

Memory: `rows` labelled rows at a time; each chunk's gradients (into h, the delta features a and W2) are
computed in the forward on two float32 (rows, V) buffers, the base logits' softmax and the final's, and
only they are kept (rows x H, rows x E, V x E), as the unary loss keeps its own
(`training.objective._ChunkedHeadLoss`) and DSpark's does (`dspark_loss._HeadTerms`). The GRU and W1 are
small (rows x (H + G)) and left to autograd through a. Under target_full a chunk holds four float32
(rows, V) buffers: the two logits' (each turned into its term's gradient in place), p_t and one scratch
(q - p_t and the L1 term's sign; the target's entropy before that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_dist.models.variants.domino_head import delta_features, prefix_states
from dflash_dist.models.variants.dspark_loss import previous_tokens


@dataclass(frozen=True)
class DominoOptions:
    lambda_fraction: float  # objective.domino_lambda_fraction: lambda reaches 0 after this share of the run


def domino_lambda(step: int, total: int, fraction: float) -> float:
    """lambda at the optimizer step after `step` taken ones of a run of `total` (0: none known)."""
    if total <= 0:
        return 0.0
    return max(0.0, 1.0 - step / max(1, math.floor(fraction * total)))


class _MixedCE(torch.autograd.Function):
    """sum_r w_r * ((1 - lam) * ce(b_r + a_r . W2) + lam * ce(b_r)) over the selected rows, `rows` rows of
    logits at a time, with each row's final and base argmax (non-differentiable). Gradients, computed in the forward
    chunk by chunk: d/db = w * ((1 - lam) * p + lam * p_b - onehot), d/d(delta) = w * (1 - lam) * (p - onehot),
    p and p_b the softmaxes of the final and the base logits."""

    @staticmethod
    def forward(ctx, h, a, w2, head_w, labels, wts, rows: int, lam: float, need_grad: bool):
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        pred, base = (torch.empty(n, dtype=torch.long, device=h.device) for _ in range(2))
        if need_grad:
            gh, ga, gw2 = torch.empty_like(h), torch.empty_like(a), torch.zeros_like(w2)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            lab, w, ak = labels[i:j, None], wts[i:j], a[i:j]
            pb = (h[i:j] @ head_w.T).float()  # base logits b
            p = torch.addmm(pb, ak, w2.T)  # final logits z = b + delta
            pred[i:j], base[i:j] = p.argmax(-1), pb.argmax(-1)
            ce = torch.zeros_like(w)
            for q, share in ((p, 1.0 - lam), (pb, lam)):
                at, top = q.gather(1, lab)[:, 0], q.max(-1).values
                q.sub_(top[:, None]).exp_()
                total = q.sum(-1)
                q.div_(total[:, None])  # the softmax, in place
                ce += share * (top + total.log() - at)
            loss += (w * ce).sum()
            if need_grad:
                minus_one = torch.full_like(w, -1.0)[:, None]
                g = p.scatter_add_(1, lab, minus_one).mul_((w * (1.0 - lam))[:, None])  # d/d(delta)
                gb = pb.scatter_add_(1, lab, minus_one).mul_((w * lam)[:, None]).add_(g)  # d/db
                gh[i:j], ga[i:j] = gb.to(head_w.dtype) @ head_w, g @ w2
                gw2.addmm_(g.T, ak)
        ctx.mark_non_differentiable(pred, base)
        if need_grad:
            ctx.save_for_backward(gh, ga, gw2)
        return loss, pred, base

    @staticmethod
    def backward(ctx, grad_loss, _grad_pred, _grad_base):
        gh, ga, gw2 = ctx.saved_tensors
        return gh * grad_loss, ga * grad_loss, gw2 * grad_loss, *([None] * 6)


def _rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """<x_r, y_r> per row as a batched matmul: no (r, V) product is made."""
    return (x[:, None, :] @ y[:, :, None])[:, 0, 0]


def _distill_in_place(z, p_t, neg_entropy, kl_w: float, l1_w: float, scratch, need_grad: bool) -> torch.Tensor:
    """D(z) per row, a * KL(p_t || q) + b * ||q - p_t||_1 with q = softmax(z), z (r, V) float32 logits;
    with `need_grad` z is left holding dD/dz = a (q - p_t) + b q (s - <q, s>), s = sign(q - p_t) (else
    garbage). KL is read as sum p_t log p_t - <p_t, log q>, the first sum (`neg_entropy`) computed once
    per chunk, so log p_t need not be kept beside p_t."""
    z.sub_(torch.logsumexp(z, -1, keepdim=True))  # log q
    term = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)
    if kl_w:
        term += kl_w * (neg_entropy - _rowdot(p_t, z))
    q = z.exp_()
    if l1_w:
        d = torch.sub(q, p_t, out=scratch)
        term += l1_w * torch.linalg.vector_norm(d, 1, dim=-1)
        if need_grad:
            s = d.sign_()
            s.sub_(_rowdot(q, s)[:, None]).mul_(q).mul_(l1_w)
    if need_grad:
        g = q.sub_(p_t).mul_(kl_w)
        if l1_w:
            g.add_(scratch)
    return term


class _MixedDistill(torch.autograd.Function):
    """target_full: sum_r w_r * ((1 - lam) * D(b_r + a_r . W2) + lam * D(b_r)) over the selected rows
    (D: `_distill_in_place`), `rows` rows at a time, each chunk's p_t computed once from the target's
    final states `last` (rows, H) and shared by both terms; with each row's final and base argmax and the
    target's top-1 (non-differentiable). Gradients in the forward: d/d(delta) = w (1 - lam) D'(z), d/db = that +
    w lam D'(b). A term whose share is 0 (lambda 0 or 1, the schedule's ends) is not computed."""

    @staticmethod
    def forward(ctx, h, a, w2, head_w, last, wts, rows: int, lam: float, kl_w: float, l1_w: float,
                need_grad: bool):
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        pred, base, top1 = (torch.empty(n, dtype=torch.long, device=h.device) for _ in range(3))
        if need_grad:
            gh, ga, gw2 = torch.empty_like(h), torch.empty_like(a), torch.zeros_like(w2)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            w, ak = wts[i:j], a[i:j]
            t = (last[i:j] @ head_w.T).float()  # the target's logits
            top1[i:j] = t.argmax(-1)
            t.sub_(torch.logsumexp(t, -1, keepdim=True))  # log p_t
            scratch = torch.exp(t)
            neg_entropy = _rowdot(scratch, t)  # sum p_t log p_t (0 where p_t underflows: log p_t is finite)
            p_t = t.exp_()
            pb = (h[i:j] @ head_w.T).float()  # base logits b
            z = torch.addmm(pb, ak, w2.T)  # final logits b + delta
            pred[i:j], base[i:j] = z.argmax(-1), pb.argmax(-1)
            term = torch.zeros_like(w)
            for buf, share in ((z, 1.0 - lam), (pb, lam)):
                if share:
                    term += share * _distill_in_place(buf, p_t, neg_entropy, kl_w, l1_w, scratch, need_grad)
            loss += (w * term).sum()
            if need_grad:
                g = z.mul_((w * (1.0 - lam))[:, None]) if lam < 1.0 else z.zero_()  # d/d(delta)
                gb = g if lam == 0.0 else pb.mul_((w * lam)[:, None]).add_(g)  # d/db
                gh[i:j], ga[i:j] = gb.to(head_w.dtype) @ head_w, g @ w2
                gw2.addmm_(g.T, ak)
        ctx.mark_non_differentiable(pred, base, top1)
        if need_grad:
            ctx.save_for_backward(gh, ga, gw2)
        return loss, pred, base, top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_pred, _grad_base, _grad_top1):
        gh, ga, gw2 = ctx.saved_tensors
        return gh * grad_loss, ga * grad_loss, gw2 * grad_loss, *([None] * 8)


def domino_term(model, hidden: torch.Tensor, chunk, lam: float):
    """(sum of w * loss, differentiable; pred and base (A, B) the final and the base logits' argmax at
    labelled slots, -1 elsewhere; the labels the metrics count: the data's, or the target's top-1 under
    target_full, which is also written to `chunk.full.top1`)."""
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
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (h, a, w2))
    full = chunk.full
    if full is None:
        loss, rows_pred, rows_base = _MixedCE.apply(h, a, w2, head_w, labels, wts, chunk.rows, float(lam), need_grad)
    else:  # the target's final state at each selected row's position (anchor + k), in the head's dtype
        last = full.last[full.pos.reshape(-1)[sel]].to(head_w.dtype)
        loss, rows_pred, rows_base, top1 = _MixedDistill.apply(
            h, a, w2, head_w, last, wts, chunk.rows, float(lam), float(full.kl_weight), float(full.l1_weight),
            need_grad)
        counted = chunk.labels.clone()
        counted.view(-1)[sel] = top1
        full.top1 = counted
    pred, base = (torch.full((A * B,), -1, dtype=torch.long, device=hidden.device) for _ in range(2))
    pred[sel], base[sel] = rows_pred, rows_base
    return loss, pred.view(A, B), base.view(A, B), chunk.labels if full is None else full.top1
