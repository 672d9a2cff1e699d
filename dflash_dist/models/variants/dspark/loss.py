"""DSpark's objective, the whole loss of an anchor chunk (the plain head's cross-entropy is not computed:
`Needs.head_loss` False).

At each trained slot k (labels and prefix-rule weights w_k = exp(-k/gamma) from the step), with the slot
logits z_k = lm_head(h_k) + W2 . W1[prev_k] (prev_k the data token at anchor + k, the anchor at k = 0)
and the target's distribution p_t,k = softmax(lm_head(last[anchor + k])) (`last`: the target's final
normed hidden state, sent as the last H columns of each feature row):

  w_k * ( a * CE(z_k, label_k) + b * ||softmax(z_k) - p_t,k||_1 + c * BCE(conf_k, 1 - ||...||_1 / 2) )

with a, b, c = variant.{ce,l1,confidence}_weight (0.1, 0.9, 1.0) and conf_k the confidence
head's output; its target, 1 - half the L1 distance, is the probability that a token drawn from the
drafter's slot k is accepted by the target's (the overlap of the two distributions), detached. The sum
is not normalised: the step divides it by the step's all-reduced weight sum like the unary loss.

Memory: `rows` labelled rows at a time (the row loop of models/head_loss.py, the unary loss's too); each
chunk's gradients (into h, W1[prev] and W2) are computed in the forward on two float32 (rows, V) buffers,
the slot's softmax and the target's, and only they are kept (rows x H, rows x r, V x r); the softmaxes
run in float32. The confidence term is small (rows x (H + r)) and left to autograd. Metrics:
teacher-forced argmax hits per slot, which equal greedy decoding's hits on the prefix that counts (a hit
means the drafted token is the data token, so the next slot's prev is too).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_dist.models.head_loss import Chunk, ChunkLoss, RowInputs, chunk_rows, with_gradients
from dflash_dist.models.variants.base import accepted_lengths
from dflash_dist.models.variants.dspark.options import DSparkOptions


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(A, B) the token before each slot's draft in training: the data token at anchor + k (the anchor's
    own at k = 0). Past the batch's end (slots without a label) a clamped, arbitrary one."""
    pos = anchors[:, None] + torch.arange(block_size, device=anchors.device)
    return input_ids[pos.clamp(max=input_ids.numel() - 1)]


class _DSparkRows(NamedTuple):
    """DSpark's data at its n labelled rows, for `_dspark_chunk`."""
    head: torch.Tensor  # (V, H) the frozen LM head
    w2: torch.Tensor  # (V, r) the Markov head's W2 (a shared input: its gradient sums over the rows)
    last: torch.Tensor  # (n, H) the target's final state at each row's position
    labels: torch.Tensor  # (n,)
    weights: torch.Tensor  # (n,) float32
    options: DSparkOptions


class _DSparkValues(NamedTuple):
    pred: torch.Tensor  # (r,) the slot logits' argmax
    l1: torch.Tensor  # (r,) ||softmax(z) - p_t||_1, which the confidence head's target reads


def _dspark_chunk(rows: _DSparkRows, chunk: Chunk) -> ChunkLoss:
    """One row chunk (the term `models.head_loss.chunk_rows` runs) of sum_r w_r * (a * ce_r + b * l1_r),
    row inputs h (r, H) and e = W1[prev] (r, r'). Its gradients come from two float32 (r, V) buffers, the
    slot's softmax p and the target's p_t, in place: d/dz = w * (a * (p - onehot) + b * p * (s - <p, s>)),
    s = sign(p - p_t), the L1 term's through the softmax."""
    o, sl = rows.options, chunk.rows
    h, ek = chunk.inputs
    lab, w, head_w = rows.labels[sl, None], rows.weights[sl], rows.head
    p = (h @ head_w.T).float().add_(ek @ rows.w2.T)  # the slot logits z
    pred = p.argmax(-1)
    at, top = p.gather(1, lab)[:, 0], p.max(-1).values
    p.sub_(top[:, None]).exp_()
    total = p.sum(-1)
    p.div_(total[:, None])  # softmax(z), in place
    ce = top + total.log() - at
    d = torch.softmax((rows.last[sl].to(head_w.dtype) @ head_w.T).float(), dim=-1).neg_().add_(p)  # p - p_t
    l1 = d.abs().sum(-1)
    loss = (w * (o.ce_weight * ce + o.l1_weight * l1)).sum()
    if not chunk.need_grad:
        return ChunkLoss(loss, _DSparkValues(pred, l1))
    g = d.sign_()
    g.sub_((p * g).sum(-1, keepdim=True)).mul_(o.l1_weight).add_(o.ce_weight).mul_(p).mul_(w[:, None])
    g.scatter_add_(1, lab, (-o.ce_weight * w)[:, None])
    return ChunkLoss(loss, _DSparkValues(pred, l1), (g.to(head_w.dtype) @ head_w, g @ rows.w2), ((g.T, ek),))


def dspark_term(model, hidden: torch.Tensor, chunk, options: DSparkOptions):
    """(sum of w * loss, differentiable; pred (A, B) the argmax at labelled slots, -1 elsewhere)."""
    s, head_w = model.spec, model.lm_head.weight
    A, B, H = hidden.shape
    if chunk.features is None or chunk.features.shape[1] != (len(s.target_layer_ids) + 1) * H:
        raise ValueError("dspark_term: the features must end with the target's final hidden state "
                         "(DSpark.needs.final_hidden; parallel/transport.py packet_spec)")
    sel = torch.nonzero(chunk.labels.reshape(-1) >= 0).squeeze(1)
    prev = previous_tokens(chunk.input_ids, chunk.anchors, B).reshape(-1)[sel]
    # The target's prediction for slot k's token is its state at anchor + k (a causal LM's next token).
    pos = (chunk.anchors[:, None] + torch.arange(B, device=hidden.device)).reshape(-1)[sel]
    h = hidden.reshape(-1, H)[sel].to(head_w.dtype)
    wts = chunk.weights.reshape(-1)[sel].float()
    markov, conf = model.markov_head, getattr(model, "confidence_head", None)
    e, w2 = markov.embed(prev), markov.markov_w2.weight
    data = _DSparkRows(head_w, w2, chunk.features[pos, -H:], chunk.labels.reshape(-1)[sel], wts, options)
    inputs = RowInputs((h, e), (w2,))
    out = chunk_rows(partial(_dspark_chunk, data), inputs, chunk.rows)
    loss = with_gradients(out, inputs)
    if conf is not None:
        accept = (1.0 - 0.5 * out.values.l1).clamp(0.0, 1.0)  # detached: the overlap of the two distributions
        bce = F.binary_cross_entropy_with_logits(conf.logit(h, e), accept, reduction="none")
        loss = loss + options.confidence_weight * (bce * wts).sum()
    pred = torch.full((A * B,), -1, dtype=torch.long, device=hidden.device)
    pred[sel] = out.values.pred
    return loss, pred.view(A, B)


def slot_metrics(pred: torch.Tensor, labels: torch.Tensor):
    """(correct (B,), accept_sum) of every slot's drafts: each slot is a draft (anchor as first)."""
    valid = labels >= 0
    hit = (pred == labels) & valid
    return hit.sum(0), accepted_lengths(hit).sum()
