"""DSpark's objective, the whole loss of an anchor chunk (the plain head's cross-entropy is not computed:
`DSpark.unary_loss` is False).

At each trained slot k (labels and prefix-rule weights w_k = exp(-k/gamma) from the step), with the slot
logits z_k = lm_head(h_k) + W2 . W1[prev_k] (prev_k the data token at anchor + k, the anchor at k = 0)
and the target's distribution p_t,k = softmax(lm_head(last[anchor + k])) (`last`: the target's final
normed hidden state, sent as the last H columns of each feature row):

  w_k * ( a * CE(z_k, label_k) + b * ||softmax(z_k) - p_t,k||_1 + c * BCE(conf_k, 1 - ||...||_1 / 2) )

with a, b, c = objective.dspark_{ce,l1,confidence}_weight (0.1, 0.9, 1.0) and conf_k the confidence
head's output; its target, 1 - half the L1 distance, is the probability that a token drawn from the
drafter's slot k is accepted by the target's (the overlap of the two distributions), detached. The sum
is not normalised: the step divides it by the step's all-reduced weight sum like the unary loss.

Memory: `rows` labelled rows at a time; each chunk's gradients (into h, W1[prev] and W2) are computed
in the forward on two float32 (rows, V) buffers, the slot's softmax and the target's, and only they are
kept (rows x H, rows x r, V x r), as the unary loss keeps its own; the softmaxes run in float32. The
confidence term is small (rows x (H + r)) and left to autograd. Metrics: teacher-forced argmax hits per slot, which equal greedy decoding's hits on the prefix
that counts (a hit means the drafted token is the data token, so the next slot's prev is too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_dist.models.variants.base import accepted_lengths


@dataclass(frozen=True)
class DSparkOptions:
    ce_weight: float  # objective.dspark_ce_weight
    l1_weight: float  # objective.dspark_l1_weight
    confidence_weight: float  # objective.dspark_confidence_weight


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(A, B) the token before each slot's draft in training: the data token at anchor + k (the anchor's
    own at k = 0). Past the batch's end (slots without a label) a clamped, arbitrary one."""
    pos = anchors[:, None] + torch.arange(block_size, device=anchors.device)
    return input_ids[pos.clamp(max=input_ids.numel() - 1)]


class _HeadTerms(torch.autograd.Function):
    """sum_r w_r * (a * ce_r + b * l1_r) over the selected rows, `rows` rows of logits at a time, with
    each row's argmax and L1 distance (non-differentiable). As the unary loss does
    (`training.objective._ChunkedHeadLoss`), the input gradients are computed chunk by chunk in the
    forward (in place on the chunk's two float32 (rows, V) buffers, the slot's softmax and the target's)
    and are all that is kept: d/dz = w * (a * (p - onehot) + b * p * (s - <p, s>)), s = sign(p - p_t),
    the L1 term's through the softmax."""

    @staticmethod
    def forward(ctx, h, e, w2, head_w, last, labels, wts, rows: int, a: float, b: float, need_grad: bool):
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        pred = torch.empty(n, dtype=torch.long, device=h.device)
        l1 = torch.empty(n, dtype=torch.float32, device=h.device)
        if need_grad:
            gh, ge, gw2 = torch.empty_like(h), torch.empty_like(e), torch.zeros_like(w2)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            lab, w, ek = labels[i:j, None], wts[i:j], e[i:j]
            p = (h[i:j] @ head_w.T).float().add_(ek @ w2.T)  # the slot logits z
            pred[i:j] = p.argmax(-1)
            at, top = p.gather(1, lab)[:, 0], p.max(-1).values
            p.sub_(top[:, None]).exp_()
            total = p.sum(-1)
            p.div_(total[:, None])  # softmax(z), in place
            ce = top + total.log() - at
            d = torch.softmax((last[i:j].to(head_w.dtype) @ head_w.T).float(), dim=-1).neg_().add_(p)  # p - p_t
            l1[i:j] = d.abs().sum(-1)
            loss += (w * (a * ce + b * l1[i:j])).sum()
            if need_grad:
                g = d.sign_()
                g.sub_((p * g).sum(-1, keepdim=True)).mul_(b).add_(a).mul_(p).mul_(w[:, None])
                g.scatter_add_(1, lab, (-a * w)[:, None])
                gh[i:j], ge[i:j] = g.to(head_w.dtype) @ head_w, g @ w2
                gw2.addmm_(g.T, ek)
        ctx.mark_non_differentiable(pred, l1)
        if need_grad:
            ctx.save_for_backward(gh, ge, gw2)
        return loss, pred, l1

    @staticmethod
    def backward(ctx, grad_loss, *_non_differentiable):
        gh, ge, gw2 = ctx.saved_tensors
        return gh * grad_loss, ge * grad_loss, gw2 * grad_loss, *([None] * 8)


def dspark_term(model, hidden: torch.Tensor, chunk, options: DSparkOptions):
    """(sum of w * loss, differentiable; pred (A, B) the argmax at labelled slots, -1 elsewhere)."""
    s, head_w = model.spec, model.lm_head.weight
    A, B, H = hidden.shape
    if chunk.features is None or chunk.features.shape[1] != (len(s.target_layer_ids) + 1) * H:
        raise ValueError("dspark_term: the features must end with the target's final hidden state "
                         "(DSpark.final_hidden_features; parallel/transport.py packet_spec)")
    sel = torch.nonzero(chunk.labels.reshape(-1) >= 0).squeeze(1)
    prev = previous_tokens(chunk.input_ids, chunk.anchors, B).reshape(-1)[sel]
    # The target's prediction for slot k's token is its state at anchor + k (a causal LM's next token).
    pos = (chunk.anchors[:, None] + torch.arange(B, device=hidden.device)).reshape(-1)[sel]
    h = hidden.reshape(-1, H)[sel].to(head_w.dtype)
    labels, wts = chunk.labels.reshape(-1)[sel], chunk.weights.reshape(-1)[sel].float()
    markov, conf = model.markov_head, getattr(model, "confidence_head", None)
    e, w2 = markov.embed(prev), markov.markov_w2.weight
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (h, e, w2))
    loss, rows_pred, l1 = _HeadTerms.apply(h, e, w2, head_w, chunk.features[pos, -H:], labels, wts, chunk.rows,
                                           options.ce_weight, options.l1_weight, need_grad)
    if conf is not None:
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)  # detached: the overlap of the two distributions
        bce = F.binary_cross_entropy_with_logits(conf.logit(h, e), accept, reduction="none")
        loss = loss + options.confidence_weight * (bce * wts).sum()
    pred = torch.full((A * B,), -1, dtype=torch.long, device=hidden.device)
    pred[sel] = rows_pred
    return loss, pred.view(A, B)


def slot_metrics(pred: torch.Tensor, labels: torch.Tensor):
    """(correct (B,), accept_sum) of every slot's drafts: each slot is a draft (anchor as first)."""
    valid = labels >= 0
    hit = (pred == labels) & valid
    return hit.sum(0), accepted_lengths(hit).sum()
