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
hidden state, which the drafter computes in the loss's row chunks (`FullTarget`, `head_loss`): forward
KL and the L1 distance, its top-1 the label of the metrics. An anchor-as-first variant (DSpark's layout)
reads slot k's at anchor + k (`label_positions`). The slots that count and their weights are those of
`block_labels` in every mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from dflash_dist.data.anchors import anchor_candidates
from dflash_dist.models.head_loss import (
    Chunk,
    ChunkLoss,
    RowInputs,
    chunk_rows,
    l1_softmax_grad,
    rescaled,
    with_gradients,
)
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


@dataclass(frozen=True)
class FullTarget:
    """objective.labels=target_full for one anchor chunk: the target's whole next-token distribution at
    each trained slot, p_t = softmax(lm_head(last[pos])), which `head_loss` computes in its own row
    chunks (never more than its `rows` x V at once) and trains the slot's q = softmax(lm_head(h)) on:
    kl_weight * KL(p_t || q) + l1_weight * ||q - p_t||_1, times the slot's weight. The target's top-1 at
    the trained slots, read off the same chunks, comes back as `HeadLoss.labels`."""
    last: torch.Tensor  # (N, H) the target's final-normed last hidden state per packed token
    pos: torch.Tensor  # (A, B) the row of `last` whose distribution is slot k's target (`label_positions`)
    kl_weight: float
    l1_weight: float


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
    # The sums of the variant's own figures by the names its `Variant.figures` declares (a scalar or a
    # (B,) vector each), which its loss term adds; summed like the fields above. Empty: none declared.
    sums: dict[str, torch.Tensor | float] = field(default_factory=dict)


# -- the plain LM head's loss, a bounded number of rows at a time (the row loop: models/head_loss.py) ---

def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """autocast's dtype where it is on (bf16 on CUDA), else the tensor's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class HeadTopK(NamedTuple):
    """The head's top-k at each row with a label, read off the loss's logits (`head_loss(top_k=k)`)."""
    ids: torch.Tensor  # (n, k) torch.topk's order: DFlash 2's served candidates (vLLM's get_top_k_tokens)
    logits: torch.Tensor  # (n, k) float32, their raw logits (topk's values, before any multiplier or cap)
    label_logits: torch.Tensor  # (n,) float32, the label's raw logit


class HeadLoss(NamedTuple):
    """What `head_loss` returns."""
    loss: torch.Tensor  # () float32 sum of w * the slot's loss, differentiable w.r.t. hidden, not normalised
    metrics: StepMetrics
    top: HeadTopK | None  # with top_k > 0
    # (A, B) the labels the metrics count against: those given, or under target_full the target's top-1 at
    # the trained slots (-100 elsewhere), which a variant's term then reads as its gold (DFlash 2's selector)
    labels: torch.Tensor


class _HeadRows(NamedTuple):
    """The plain head's data at its n labelled rows, in the label mode's form."""
    head: torch.Tensor  # (V, H) the frozen head in the compute dtype
    labels: torch.Tensor  # (n,) hard labels (target_soft's top-1; under target_full unused)
    weights: torch.Tensor  # (n,) float32 position weights
    soft: tuple[torch.Tensor, torch.Tensor] | None  # target_soft: (probs, ids) (n, k)
    full: tuple[torch.Tensor, torch.Tensor, float, float] | None  # target_full: (last, its row per row, KL w, L1 w)
    top_k: int


class _HeadValues(NamedTuple):
    """The plain head's per-row results (None: not asked for in this mode)."""
    pred: torch.Tensor  # the argmax of the drafter's logits
    term: torch.Tensor  # the row's unweighted loss (cross-entropy or distillation): D-PACE's weights read it
    top_ids: torch.Tensor | None  # `HeadTopK`'s three, with top_k > 0
    top_logits: torch.Tensor | None
    label_logits: torch.Tensor | None
    top1: torch.Tensor | None  # target_full: the target's top-1


class _ModeLoss(NamedTuple):
    """A label mode's loss of a chunk's float32 logits z (r, V)."""
    loss: torch.Tensor  # () sum of w * term
    term: torch.Tensor  # (r,) each row's unweighted loss
    pred: torch.Tensor  # (r,) the argmax of z
    grad: torch.Tensor | None  # d loss / dz (r, V) float32 (in z's or the target's buffer), None without need_grad


def _head_chunk(rows: _HeadRows, chunk: Chunk) -> ChunkLoss:
    """One row chunk of the plain head's loss (the term `chunk_rows` runs): the logits in the compute
    dtype, then float32 for the label mode's loss (`_ce_rows`, `_distill_rows`), whose logit gradient is
    taken to the rows' input gradient here (d/dx = d/dz @ W). All vocabulary-sized tensors die when this
    returns. Under target_full the target's logits come first: their top-1 is the label whose logit the
    top-K reads."""
    w, sl = rows.head, chunk.rows
    x = chunk.inputs[0].to(w.dtype)
    labels, teacher = rows.labels[sl], None
    if rows.full is not None:
        last, at = rows.full[0], rows.full[1][sl]
        teacher = (last[at].to(w.dtype) @ w.T).float()  # the target's logits; a bf16 matmul output dies here
        labels = teacher.argmax(-1)
    raw = x @ w.T  # (r, V)
    top = _top_k(raw, rows.top_k, labels)  # before the in-place softmax overwrites raw (z when already float32)
    z = raw.float()
    del raw  # a bf16 matmul output would otherwise live beside its float32 copy to the end of the chunk
    if teacher is not None:
        out = _distill_rows(z, teacher, rows.weights[sl], rows.full[2], rows.full[3], chunk.need_grad)
    else:
        soft = None if rows.soft is None else (rows.soft[0][sl], rows.soft[1][sl])
        out = _ce_rows(z, labels, rows.weights[sl], soft, chunk.need_grad)
    values = _HeadValues(out.pred, out.term, *top, labels if teacher is not None else None)
    return ChunkLoss(out.loss, values, (out.grad.to(x.dtype) @ w,) if chunk.need_grad else ())


def _top_k(raw: torch.Tensor, k: int, labels: torch.Tensor) -> tuple:
    """(ids, logits, the label's logit) of `HeadTopK` for these rows, in the logits' own dtype (what
    `unary_top_k` gives), as float32; three None without k."""
    if not k:
        return None, None, None
    values, ids = raw.topk(k, dim=-1)
    return ids, values.float(), raw.gather(1, labels[:, None])[:, 0].float()


def _ce_rows(z, labels, wts, soft, need_grad: bool) -> _ModeLoss:
    """data and target_argmax (one label per row) and target_soft (soft: probs and ids (r, k) of the
    target's top-k): w * the cross-entropy of softmax(z). The softmax runs in place on z (torch.logsumexp
    would allocate another (r, V)), which thus becomes the gradient: d(w * ce)/dz = w * (softmax * sum(p)
    - p at the target ids)."""
    ids = labels[:, None] if soft is None else soft[1]
    at = z.gather(1, ids)  # target logits, before z is overwritten
    top, arg = z.max(dim=-1)
    e = z.sub_(top[:, None]).exp_()
    total = e.sum(-1)
    logq = at - (top + total.log())[:, None]
    ce = -logq.squeeze(1) if soft is None else -(soft[0] * logq).sum(-1)
    g = None
    if need_grad:
        p = torch.ones_like(at) if soft is None else soft[0]
        g = e.mul_((wts * p.sum(-1) / total)[:, None])
        g.scatter_add_(1, ids, -p * wts[:, None])
    return _ModeLoss((ce * wts).sum(), ce, arg, g)


def _distill_rows(z, t, wts, kl_w: float, l1_w: float, need_grad: bool) -> _ModeLoss:
    """target_full: z, t (r, V) float32, the drafter's and the target's logits (both overwritten):
    w * (kl_w * KL(p_t || q) + l1_w * ||q - p_t||_1), q = softmax(z), p_t = softmax(t); the gradient
    d/dz = w * (kl_w * (q - p_t) + l1_w * q * (s - <q, s>)), s = sign(q - p_t) (`l1_softmax_grad`). At most
    three float32 (r, V) buffers live: z, t and p_t; every step is in place on them (logsumexp's own
    temporary comes and goes before p_t exists)."""
    pred = z.argmax(-1)
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
    g = None
    if need_grad:
        s = l1_softmax_grad(q, p.copy_(d).sign_(), l1_w) if l1_w else None  # p_t is no longer needed
        g = d.mul_(kl_w) if s is None else d.mul_(kl_w).add_(s)
        g.mul_(wts[:, None])
    return _ModeLoss((term * wts).sum(), term, pred, g)


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
    (`Needs.head_loss` False): the labels and weights counted, nothing hit."""
    zero = weights.new_zeros((), dtype=torch.float32)
    return zero, _metrics(torch.full_like(labels, -1), labels, zero, weights.sum())


def _head_rows(head_weight, labels, weights, soft, full: FullTarget | None, top_k: int, sel, dt) -> _HeadRows:
    """The loss's data at the labelled rows `sel` (flat indices into (A, B)), in the compute dtype `dt`."""
    probs = None
    if soft is not None:
        k = soft[0].shape[-1]
        probs = soft[0].reshape(-1, k)[sel].float(), soft[1].reshape(-1, k)[sel]
    teacher = None
    if full is not None:
        teacher = (full.last, full.pos.reshape(-1)[sel], float(full.kl_weight), float(full.l1_weight))
    return _HeadRows(head_weight.to(dt), labels.reshape(-1)[sel], weights.reshape(-1)[sel].float(), probs, teacher,
                     top_k)


def head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
              soft: tuple[torch.Tensor, torch.Tensor] | None = None, rows: int = 8192,
              dpace_alpha: float | None = None, top_k: int = 0, full: FullTarget | None = None) -> HeadLoss:
    """The frozen LM head and the weighted loss of the plain reference (tests/oracles.py), never more than
    `rows` rows x V logits alive at once (forward and backward).

    hidden (A, B, H): final-normed drafter states; head_weight (V, H): the target's frozen lm_head.weight;
    labels/weights (A, B) from `block_labels` (or `argmax_block_labels`; for target_soft, the top-1 labels
    of `soft_block_targets`, whose (probs, ids) (A, B, k) are `soft`). Only rows with a label (>= 0) are
    computed. The loss is not normalised, so that chunks of one batch add up; the caller divides by
    `loss_denominator`. With `dpace_alpha` (hard labels only) each slot's weight is `weights` x its D-PACE
    weight (`dpace_weights`, from the rows' own cross-entropy, whichever row chunk they fall in); `weights`
    then is 1 on the trained slots. Logits are a matmul in the compute dtype (autocast's, else hidden's),
    then float32 for the softmax. With `top_k` > 0, `HeadTopK` of the n rows with a label in their (A, B)
    order: the ids torch.topk gives (what `models.variants.dflash2.modules.unary_top_k` gives those rows in the same compute
    dtype), their logits and the label's, read off the same chunks (no rows x V kept). With `full`
    (objective.labels=target_full) each trained slot's loss is `FullTarget`'s, against the target's whole
    distribution computed in the same row chunks; `labels` then only say which slots train, and the
    metrics (and the top-K's label logit) count against the target's top-1 (`HeadLoss.labels`)."""
    if head_weight.requires_grad:
        raise ValueError("lm_head_loss: the LM head must be frozen (its weight requires grad)")
    if rows < 1:
        raise ValueError(f"lm_head_loss: rows must be >= 1, got {rows}")
    if dpace_alpha is not None and (soft is not None or full is not None):
        raise ValueError("lm_head_loss: D-PACE needs hard labels (its confidence is the label's probability)")
    if full is not None and soft is not None:
        raise ValueError("lm_head_loss: target_full's distribution and top-k soft targets are two label modes")
    A, B, _ = hidden.shape
    sel = torch.nonzero(labels.reshape(-1) >= 0).squeeze(1)
    dt = _compute_dtype(hidden)
    data, inputs = _head_rows(head_weight, labels, weights, soft, full, top_k, sel, dt), RowInputs((hidden,), (), sel)
    out = chunk_rows(partial(_head_chunk, data), inputs, rows, grad_dtype=dt)
    weight_sum = weights.sum()
    if dpace_alpha is not None:  # weights that need every row's loss first (`rescaled`)
        factor = _dpace_rows(out.values.term, sel, labels >= 0, dpace_alpha)
        used = data.weights * factor
        out, weight_sum = rescaled(out, (out.values.term * used).sum(), factor), used.sum()
    loss = with_gradients(out, inputs)
    v = out.values
    with torch.no_grad():
        pred = torch.full((A * B,), -1, dtype=torch.long, device=hidden.device)
        pred[sel] = v.pred
        if full is not None:  # the target's top-1 on the trained slots: what the metrics count against
            labels = labels.clone()
            labels.view(-1)[sel] = v.top1
        m = _metrics(pred.view(A, B), labels, loss.detach(), weight_sum)
    return HeadLoss(loss, m, HeadTopK(v.top_ids, v.top_logits, v.label_logits) if top_k > 0 else None, labels)


def lm_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                 soft: tuple[torch.Tensor, torch.Tensor] | None = None, rows: int = 8192,
                 dpace_alpha: float | None = None, top_k: int = 0, full: FullTarget | None = None):
    """`head_loss` as (loss, metrics), with top_k > 0 (loss, metrics, top) (the target's top-1 under
    target_full is `head_loss`'s `labels`)."""
    out = head_loss(hidden, head_weight, labels, weights, soft, rows, dpace_alpha, top_k, full)
    return (out.loss, out.metrics, out.top) if top_k > 0 else (out.loss, out.metrics)


def _dpace_rows(ce_rows: torch.Tensor, sel: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """`dpace_weights` of the selected rows (flat indices `sel` into the (A, B) blocks), from their ce."""
    ce = torch.zeros(trained.numel(), dtype=torch.float32, device=ce_rows.device)
    ce[sel] = ce_rows
    return dpace_weights(ce.view(trained.shape), trained, alpha).reshape(-1)[sel]
