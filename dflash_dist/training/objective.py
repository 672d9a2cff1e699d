"""The DFlash training objective: anchors, block labels, position weights (gamma decay or D-PACE), loss, metrics.

Anchors of a sequence are drawn uniformly without replacement among the positions p whose next token is
supervised (so p <= len - 2). A block may run past the sequence's end: its slots there carry no label and
no weight (`block_labels`), so every supervised token, the end-of-turn marker included, is trained at
every slot from 1 on, and a response shorter than a block is trained. The anchor itself need not be
supervised: the last prompt token anchors the response's first block (one block per turn), which keeps a
one-token answer (a bare end-of-turn) trainable; docs/architecture.md says why. The draw uses a
generator seeded by (seed, epoch, batch) alone, so a batch seen again (after a resume) gets the same
anchors on any rank.

Labels (`objective.labels`): `data` trains slot k on the token at anchor + k; `target_argmax` on the
target's greedy token for that position and `target_soft` on the target's top-k distribution for it, both
read from the target's logits at anchor + k - 1 (a causal LM's prediction for the next position);
`target_full` on the target's whole distribution there, softmax(lm_head(last)) of its final-normed last
hidden state, which the drafter computes in the loss's row chunks (`FullTarget`, `lm_head_loss`): forward
KL and the L1 distance, its top-1 the label of the metrics. An anchor-as-first variant (DSpark's layout)
reads slot k's at anchor + k (`label_positions`). The slots that count and their weights are those of
`block_labels` in every mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from dflash_dist.data.anchors import anchor_candidates
from dflash_dist.models.variants.base import accepted_lengths
from dflash_dist.plan.seeding import seeded_generator


def anchor_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    return seeded_generator(seed, epoch, batch)


def draw_anchors(loss_mask, cu_seqlens, num_anchors: int, gen: torch.Generator):
    """Returns (anchors (A,) packed indices sorted, anchor_cu (S+1,)). All on CPU. Each sequence [s, e)
    gives min(num_anchors, its candidates) anchors, drawn from the rule's candidates (`data.anchors`)."""
    loss_mask, cu = loss_mask.cpu(), cu_seqlens.cpu().tolist()
    chosen, counts = [], []
    for s, e in zip(cu[:-1], cu[1:]):
        cand = anchor_candidates(loss_mask[s:e]) + s
        k = min(num_anchors, cand.numel())
        pick = cand[torch.randperm(cand.numel(), generator=gen)[:k]].sort().values
        chosen.append(pick)
        counts.append(k)
    anchors = torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long)
    anchor_cu = torch.zeros(len(counts) + 1, dtype=torch.long)
    anchor_cu[1:] = torch.tensor(counts, dtype=torch.long).cumsum(0)
    return anchors, anchor_cu


def block_labels(input_ids, loss_mask, cu_seqlens, anchors, anchor_cu, block_size: int, gamma: float,
                 anchor_drafts: bool = False, prefix: bool = False):
    """labels (A, B) (-100 where untrained) and weights (A, B): exp(-(k-1)/gamma) for slot k >= 1 whose
    target anchor+k lies inside the anchor's sequence and the loss mask; 0 elsewhere and in slot 0.
    A variant's layout (`Variant.anchor_drafts`, DSpark's): slot k's target is anchor+k+1, every slot
    trains, weight exp(-k/gamma); with `prefix` a slot after an untrained one trains neither."""
    dev = input_ids.device
    B, first = block_size, int(anchor_drafts)  # first: the offset of slot 0's target
    seq_end = torch.repeat_interleave(cu_seqlens[1:], anchor_cu[1:] - anchor_cu[:-1])  # (A,)
    pos = anchors[:, None] + torch.arange(first, B + first, device=dev)  # (A, B)
    inside = pos < seq_end[:, None]
    pos_c = pos.clamp(max=input_ids.numel() - 1)
    valid = inside & loss_mask[pos_c]
    if not anchor_drafts:
        valid[:, 0] = False
    if prefix:
        valid[:, 1 - first:] = valid[:, 1 - first:].cumprod(1).bool()
    labels = torch.where(valid, input_ids[pos_c], torch.full_like(pos_c, -100))
    decay = torch.exp(-(torch.arange(B, device=dev, dtype=torch.float32) - (1 - first)) / gamma)
    weights = valid.float() * decay
    return labels, weights


@torch.no_grad()
def dpace_weights(ce: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's position weights (arXiv 2605.18810, Eqs. 7-8) for blocks (A, B): ce the cross-entropy of
    each slot's label, `trained` the slots that have one. q = exp(-ce) is the drafter's probability of the
    label, smoothed to q~ = (1 - alpha) q + alpha; a block's surrogate accepted length is
    sum_m prod_{i<=m} q~_i over its trained slots m, and slot k's weight is that sum's derivative with
    respect to log q~_k: w_k = sum_{m>=k} prod_{i<=m} q~_i, the chance of reaching k times the length still
    to gain from there. Untrained slots (slot 0, past the sequence or the loss mask) are a factor 1 in the
    products, as the reference implementation treats them, and get weight 0. Detached: the weights
    shape the gradient of -log q_k (Eq. 9) and carry none themselves. Each block's weights depend on that
    block alone, so anchor chunks and LM-head row chunks leave them unchanged."""
    smooth = torch.where(trained, (1.0 - alpha) * torch.exp(-ce.float()) + alpha, 1.0)
    reach = torch.where(trained, torch.cumprod(smooth, dim=1), 0.0)  # prod_{i<=m} q~_i on the trained m
    return torch.where(trained, reach.flip(1).cumsum(1).flip(1), 0.0)  # sums over m >= k


def loss_denominator(dpace: bool, weight_sum, num_blocks):
    """What a summed weighted loss is divided by. Fixed decay weights: their sum (a weighted mean over the
    trained slots). D-PACE: the number of blocks (anchors; every anchor has a trained slot 1), not the
    weight sum: the weights are expected accepted-length credit, which dividing by their sum would cancel
    (the D-PACE author on SpecForge issue 828; its fix, PR 848, divides by anchors). Summed over all the
    drafters of a step (loss_norm=step), it is the same on every rank."""
    return num_blocks if dpace else weight_sum


@torch.no_grad()
def target_predictions(logits: torch.Tensor, labels: str, soft_top_k: int):
    """What a target sends from its logits (N, V): ids (N, w) int64 and, for soft labels, the matching
    top-k logits (N, k) float32 (else None). `topk` sorts descending, so column 0 is the top-1 token."""
    if labels == "target_argmax":
        return logits.argmax(-1, keepdim=True), None
    if labels == "target_soft":
        values, ids = logits.topk(soft_top_k, dim=-1)
        return ids, values.float()
    raise ValueError(f"objective.labels={labels!r} takes no target predictions")


def predictions_from_hidden(final: torch.Tensor, lm_head, labels: str, soft_top_k: int, chunk: int = 4096):
    """`target_predictions(lm_head(final))`, a chunk of tokens at a time. The whole (N, V) logits of a
    49,152-token Qwen3 batch (V = 151,936) are 13.9 GiB in bf16; a 4,096-token chunk is 1.2 GiB."""
    parts = [target_predictions(lm_head(final[i:i + chunk]), labels, soft_top_k) for i in range(0, len(final), chunk)]
    ids = torch.cat([p[0] for p in parts])
    return ids, torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None


def label_positions(anchors: torch.Tensor, block_size: int, num_tokens: int, anchor_drafts: bool = False):
    """(A, B) the packed position whose next-token prediction is slot k's label: anchor + k - 1 (DFlash:
    slot k's label is the token at anchor + k), anchor + k with `anchor_drafts` (anchor as first: slot k's
    label is at anchor + k + 1). Clamped into [0, num_tokens): untrained slots (DFlash's slot 0, a slot
    past the sequence) read an arbitrary row, which their label (-100) masks."""
    pos = anchors[:, None] + torch.arange(block_size, device=anchors.device) - (0 if anchor_drafts else 1)
    return pos.clamp(0, num_tokens - 1)


def _predicted_at(per_token: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """per_token (N, ...) indexed at anchor + k - 1 for every slot: (A, B, ...). Untrained slots (slot 0,
    or anchor + k past the sequence) read a clamped, arbitrary row; callers mask them with `labels`."""
    return per_token[label_positions(anchors, labels.shape[1], per_token.shape[0])]


def argmax_block_labels(target_ids: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Data labels (A, B) from `block_labels` -> the target's greedy tokens (N,) at anchor + k - 1, on
    exactly the same trained slots (-100 elsewhere)."""
    return torch.where(labels >= 0, _predicted_at(target_ids, labels, anchors), labels)


def soft_block_targets(top_values: torch.Tensor, top_ids: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor):
    """Top-k logits/ids (N, k) -> (probs (A, B, k): softmax renormalised over the top k, ids (A, B, k),
    top-1 labels (A, B) on the trained slots of `labels`, -100 elsewhere; used for the metrics)."""
    ids = _predicted_at(top_ids, labels, anchors)
    probs = torch.softmax(_predicted_at(top_values, labels, anchors).float(), dim=-1)
    return probs, ids, torch.where(labels >= 0, ids[..., 0], labels)


@dataclass
class FullTarget:
    """objective.labels=target_full for one anchor chunk: the target's whole next-token distribution at
    each trained slot, p_t = softmax(lm_head(last[pos])), which `lm_head_loss` computes in its own row
    chunks (never more than its `rows` x V at once) and trains the slot's q = softmax(lm_head(h)) on:
    kl_weight * KL(p_t || q) + l1_weight * ||q - p_t||_1, times the slot's weight.

    `top1` is filled by `lm_head_loss`: (A, B) the target's top-1 at the trained slots (-100 elsewhere),
    the labels its metrics count against (as target_soft's top-1 labels) and a variant's term reads."""
    last: torch.Tensor  # (N, H) the target's final-normed last hidden state per packed token
    pos: torch.Tensor  # (A, B) the row of `last` whose distribution is slot k's target (`label_positions`)
    kl_weight: float
    l1_weight: float
    top1: torch.Tensor | None = None


@dataclass
class StepMetrics:
    """A batch's (or chunk's) metrics. From `lm_head_loss` every field but num_blocks is a tensor on the
    step's device, so a step reads them to the host once (with its stats), not once per chunk (the
    tests' plain reference loss, tests/oracles.py, returns host numbers)."""
    loss_sum: float | torch.Tensor  # sum of w * ce
    weight_sum: float | torch.Tensor
    correct: torch.Tensor  # (B,) correct predictions per slot
    valid: torch.Tensor  # (B,) trained labels per slot
    accept_sum: float | torch.Tensor  # sum over blocks of the accepted prefix length (+1 bonus)
    num_blocks: int
    # DFlash 2 (models/variants/dflash2_loss.py): correct/accept_sum then follow the selector's walk; these hold the
    # unary head's own figures, the selector term's sum of w * ce and the top-K's recall of the gold.
    unary_correct: torch.Tensor | None = None
    unary_accept_sum: float | torch.Tensor | None = None
    selector_loss_sum: float | torch.Tensor | None = None
    topk_hits: torch.Tensor | None = None


# -- the LM head and loss, a bounded number of rows at a time ------------------------------------------

def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """autocast's dtype where it is on (bf16 on CUDA), else the tensor's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum_r w_r * ce_r over the selected rows of `hidden`, `rows` rows of logits at a time.

    The input gradient is computed chunk by chunk in the forward and is all that is saved (rows x H in
    the compute dtype, next to nothing beside the activations): recomputing the logits in the backward
    would cost a third (rows x H x V) matmul per chunk where this costs two, and the LM head is about a
    quarter of a drafter step's FLOPs. The price is computing a gradient nobody may ask for, so it is
    skipped when autograd will not need it. With `top_k` each row's top-k (`HeadTopK`) is read off the same
    logits (DFlash 2's candidates: no second pass of the head). With `full` ((last, its row per selected
    row, KL weight, L1 weight): target_full) each row's target distribution is computed in the same chunk
    (`_distill_rows`) and `tlab` holds its top-1."""

    @staticmethod
    def forward(ctx, hidden, weight, sel, labels, wts, probs, ids, rows: int, need_grad: bool, weigh, top_k: int,
                full=None):
        dt = _compute_dtype(hidden)
        flat = hidden.reshape(-1, hidden.shape[-1])
        n = sel.numel()
        pred = torch.empty(n, dtype=torch.long, device=hidden.device)
        tlab = torch.empty(n if full is not None else 0, dtype=torch.long, device=hidden.device)
        grad = torch.empty(n, flat.shape[1], dtype=dt, device=hidden.device) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device) if weigh is not None else None
        top = HeadTopK(torch.empty(n, top_k, dtype=torch.long, device=hidden.device),
                       torch.empty(n, top_k, dtype=torch.float32, device=hidden.device),
                       torch.empty(n if top_k else 0, dtype=torch.float32, device=hidden.device))
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dt)  # a no-op when the head is already in the compute dtype (bf16 on CUDA)
            for i in range(0, n, rows):
                j = min(n, i + rows)
                soft = None if probs is None else (probs[i:j], ids[i:j])
                teacher = None if full is None else (full[0][full[1][i:j]].to(dt), full[2], full[3], tlab[i:j])
                loss += _head_chunk(flat[sel[i:j]].to(dt), w, labels[i:j], wts[i:j], soft, pred[i:j],
                                    grad[i:j] if need_grad else None, None if ce is None else ce[i:j],
                                    HeadTopK(*(t[i:j] for t in top)) if top_k else None, teacher)
        used = wts.new_empty(0)  # the weights in effect, when they are not the given ones
        if weigh is not None:  # weights that need every row's loss first: each row's gradient is linear in its
            factor = weigh(ce)  # weight, so the chunks' gradients (at weight wts) are scaled now, no recompute
            used = wts * factor
            loss = (ce * used).sum()
            if need_grad:
                grad.mul_(factor[:, None].to(grad.dtype))
        ctx.mark_non_differentiable(pred, tlab, used, *top)
        if need_grad:
            ctx.save_for_backward(grad, sel)
            ctx.shape, ctx.dtype = hidden.shape, hidden.dtype
        return loss, pred, tlab, used, *top

    @staticmethod
    def backward(ctx, grad_loss, *_non_differentiable):
        grad, sel = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        out.view(-1, ctx.shape[-1]).index_copy_(0, sel, (grad * grad_loss).to(ctx.dtype))
        return out, *([None] * 11)


class HeadTopK(NamedTuple):
    """The head's top-k at each row with a label, read off the loss's logits (`lm_head_loss(top_k=k)`)."""
    ids: torch.Tensor  # (n, k) torch.topk's order: DFlash 2's served candidates (vLLM's get_top_k_tokens)
    logits: torch.Tensor  # (n, k) float32, their raw logits (topk's values, before any multiplier or cap)
    label_logits: torch.Tensor  # (n,) float32, the label's raw logit


def _head_chunk(x, w, labels, wts, soft, pred_out, grad_out, ce_out=None, top_out=None, full=None) -> torch.Tensor:
    """One row chunk: writes the argmax into pred_out, if given d(sum w * ce)/dx into grad_out, each
    row's ce into ce_out and its top-k (`HeadTopK`, k its width) into top_out; returns sum w * ce. The
    softmax runs in place on the float32 logits (torch.logsumexp would allocate another (r, V)), so they
    are the only vocabulary-sized tensor besides the compute-dtype matmul output and input; all die when
    this returns. With `full` ((the target's final states of these rows, KL weight, L1 weight, top-1
    out): target_full) the loss is `_distill_rows`'s, against the rows' target distribution, and the
    labels that top_out's label logit reads are the target's top-1."""
    teacher = None
    if full is not None:  # first: its top-1 is the label that top_out's label logit reads
        teacher = (full[0] @ w.T).float()  # the target's logits; a bf16 matmul output dies here
        labels = teacher.argmax(-1)
        full[3].copy_(labels)
    raw = x @ w.T  # (r, V)
    if top_out is not None:  # before the in-place softmax overwrites raw (it is z when already float32)
        values, ids = raw.topk(top_out.ids.shape[1], dim=-1)  # `unary_top_k`'s topk, in the same dtype
        top_out.ids.copy_(ids)
        top_out.logits.copy_(values)
        top_out.label_logits.copy_(raw.gather(1, labels[:, None])[:, 0])
    z = raw.float()
    del raw  # a bf16 matmul output would otherwise live beside its float32 copy to the end of the chunk
    if teacher is not None:
        return _distill_rows(z, teacher, w, wts, full[1], full[2], pred_out, grad_out, ce_out, x.dtype)
    at = z.gather(1, labels[:, None] if soft is None else soft[1])  # target logits, before z is overwritten
    top, arg = z.max(dim=-1)
    pred_out.copy_(arg)
    e = z.sub_(top[:, None]).exp_()
    total = e.sum(-1)
    logq = at - (top + total.log())[:, None]
    ce = -logq.squeeze(1) if soft is None else -(soft[0] * logq).sum(-1)
    if ce_out is not None:
        ce_out.copy_(ce)
    if grad_out is not None:  # d(w * ce)/dz = w * (softmax * sum(p) - p at the target ids), in place
        p = torch.ones_like(at) if soft is None else soft[0]
        g = e.mul_((wts * p.sum(-1) / total)[:, None])
        g.scatter_add_(1, labels[:, None] if soft is None else soft[1], -p * wts[:, None])
        grad_out.copy_(g.to(x.dtype) @ w)
    return (ce * wts).sum()


def _distill_rows(z, t, w, wts, kl_w: float, l1_w: float, pred_out, grad_out, ce_out, dtype) -> torch.Tensor:
    """target_full's rows: z, t (r, V) float32, the drafter's and the target's logits (both overwritten);
    returns sum_r wts_r * (kl_w * KL(p_t || q) + l1_w * ||q - p_t||_1), q = softmax(z), p_t = softmax(t),
    writing the argmax of z into pred_out, each row's unweighted term into ce_out and, if given, the
    gradient into grad_out: d/dz = wts * (kl_w * (q - p_t) + l1_w * q * (s - <q, s>)), s = sign(q - p_t)
    (the L1 term's through the softmax, as models/variants/dspark_loss.py's). At most three float32 (r, V)
    buffers live: z, t and p_t; every step is in place on them (logsumexp's own temporary comes and goes
    before p_t exists)."""
    pred_out.copy_(z.argmax(-1))
    z.sub_(torch.logsumexp(z, -1, keepdim=True))  # log q
    t.sub_(torch.logsumexp(t, -1, keepdim=True))  # log p_t
    p = t.exp()
    term = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)
    if kl_w:  # KL = sum p_t (log p_t - log q); a p_t that underflows to 0 adds 0 (its log stays finite)
        term += kl_w * t.sub_(z).mul_(p).sum(-1)
    q = z.exp_()
    d = torch.sub(q, p, out=t)  # q - p_t, in the buffer log p_t no longer needs
    if l1_w:
        term += l1_w * torch.linalg.vector_norm(d, 1, dim=-1)
    if ce_out is not None:
        ce_out.copy_(term)
    if grad_out is not None:
        if l1_w:
            s = p.copy_(d).sign_()  # p_t is no longer needed
            qs = (q[:, None, :] @ s[:, :, None])[:, 0, 0]  # <q, s> per row, without an (r, V) product
            s.sub_(qs[:, None]).mul_(q).mul_(l1_w)
            g = d.mul_(kl_w).add_(s)
        else:
            g = d.mul_(kl_w)
        grad_out.copy_(g.mul_(wts[:, None]).to(dtype) @ w)
    return (term * wts).sum()


def _metrics(pred: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor, weight_sum: torch.Tensor) -> StepMetrics:
    """The metrics of a batch from the predicted tokens (A, B) (any value where labels < 0), left
    on the device."""
    valid = labels >= 0
    hit = (pred == labels) & valid
    run = accepted_lengths(hit[:, 1:])
    return StepMetrics(loss_sum=loss_sum, weight_sum=weight_sum, correct=hit.sum(0), valid=valid.sum(0),
                       accept_sum=run.sum(), num_blocks=labels.shape[0])


def no_head_loss(labels: torch.Tensor, weights: torch.Tensor):
    """(a zero loss, the metrics of no prediction) for a variant whose `loss_term` is the whole loss
    (`Variant.unary_loss` False): the labels and weights counted, nothing hit."""
    zero = weights.new_zeros((), dtype=torch.float32)
    return zero, _metrics(torch.full_like(labels, -1), labels, zero, weights.sum())


def lm_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                 soft: tuple[torch.Tensor, torch.Tensor] | None = None, rows: int = 8192,
                 dpace_alpha: float | None = None, top_k: int = 0, full: FullTarget | None = None):
    """The frozen LM head and the weighted cross-entropy of the plain reference (tests/oracles.py), never more than `rows` rows x V
    logits alive at once (forward and backward).

    hidden (A, B, H): final-normed drafter states; head_weight (V, H): the target's frozen lm_head.weight;
    labels/weights (A, B) from `block_labels` (or `argmax_block_labels`; for target_soft, the top-1 labels
    of `soft_block_targets`, whose (probs, ids) (A, B, k) are `soft`). Only rows with a label (>= 0) are
    computed. Returns (sum of w * ce as a float32 scalar differentiable w.r.t. hidden, StepMetrics): the sum
    is not normalised, so that chunks of one batch add up; the caller divides by `loss_denominator`.
    With `dpace_alpha` (hard labels only) each slot's weight is `weights` x its D-PACE weight
    (`dpace_weights`, from the rows' own cross-entropy, whichever row chunk they fall in); `weights` then
    is 1 on the trained slots. Logits are a matmul in the compute dtype (autocast's, else hidden's), then
    float32 for the softmax. With `top_k` > 0 a third value, a `HeadTopK` of the n rows with a label in
    their (A, B) order: the ids torch.topk gives (what `models.dflash2.unary_top_k` gives those rows in
    the same compute dtype), their logits and the label's, read off the same chunks (no rows x V kept).
    With `full` (objective.labels=target_full) each trained slot's loss is `FullTarget`'s, against the
    target's whole distribution computed in the same row chunks; `labels` then only say which slots train,
    the metrics (and the top-K's label logit) count against the target's top-1, written to `full.top1`."""
    if head_weight.requires_grad:
        raise ValueError("lm_head_loss: the LM head must be frozen (its weight requires grad)")
    if rows < 1:
        raise ValueError(f"lm_head_loss: rows must be >= 1, got {rows}")
    A, B, _ = hidden.shape
    sel = torch.nonzero(labels.reshape(-1) >= 0).squeeze(1)
    lab = labels.reshape(-1)[sel]
    wts = weights.reshape(-1)[sel].float()
    probs = ids = None
    if soft is not None:
        k = soft[0].shape[-1]
        probs, ids = soft[0].reshape(-1, k)[sel].float(), soft[1].reshape(-1, k)[sel]
    weigh = None
    if dpace_alpha is not None:
        if soft is not None or full is not None:
            raise ValueError("lm_head_loss: D-PACE needs hard labels (its confidence is the label's probability)")
        weigh = partial(_dpace_rows, sel=sel, trained=labels >= 0, alpha=dpace_alpha)
    teacher = None
    if full is not None:
        if soft is not None:
            raise ValueError("lm_head_loss: target_full's distribution and top-k soft targets are two label modes")
        teacher = (full.last, full.pos.reshape(-1)[sel], float(full.kl_weight), float(full.l1_weight))
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    loss, pred_rows, tlab, used, *top = _ChunkedHeadLoss.apply(hidden, head_weight, sel, lab, wts, probs, ids, rows,
                                                               need_grad, weigh, top_k, teacher)
    with torch.no_grad():
        pred = torch.full((A * B,), -1, dtype=torch.long, device=hidden.device)
        pred[sel] = pred_rows
        if full is not None:  # the target's top-1 on the trained slots: what the metrics count against
            labels = labels.clone()
            labels.view(-1)[sel] = tlab
            full.top1 = labels
        m = _metrics(pred.view(A, B), labels, loss.detach(), weights.sum() if weigh is None else used.sum())
    return (loss, m, HeadTopK(*top)) if top_k > 0 else (loss, m)


def _dpace_rows(ce_rows: torch.Tensor, sel: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """`dpace_weights` of the selected rows (flat indices `sel` into the (A, B) blocks), from their ce."""
    ce = torch.zeros(trained.numel(), dtype=torch.float32, device=ce_rows.device)
    ce[sel] = ce_rows
    return dpace_weights(ce.view(trained.shape), trained, alpha).reshape(-1)[sel]
