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

Memory: `rows` labelled rows at a time, each chunk under activation checkpointing, so its (rows, V)
logits, softmaxes and the target's are recomputed in the backward rather than kept; the softmaxes run in
float32. Metrics: teacher-forced argmax hits per slot, which equal greedy decoding's hits on the prefix
that counts (a hit means the drafted token is the data token, so the next slot's prev is too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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


def _rows_loss(h, e, last, labels, wts, head_w, w2, conf, options: DSparkOptions):
    """(sum of the weighted loss, argmax) of one row chunk: h (n, H) final states, e (n, r) Markov
    embeddings, last (n, H) the target's final hidden states, labels/wts (n,)."""
    z = (h @ head_w.T).float() + (e @ w2.T).float()
    logq = torch.log_softmax(z, dim=-1)
    ce = F.nll_loss(logq, labels, reduction="none")
    with torch.no_grad():
        p_t = torch.softmax((last.to(head_w.dtype) @ head_w.T).float(), dim=-1)
    l1 = (logq.exp() - p_t).abs().sum(-1)
    loss = options.ce_weight * ce + options.l1_weight * l1
    if conf is not None:
        accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
        loss = loss + options.confidence_weight * F.binary_cross_entropy_with_logits(conf.logit(h, e), accept,
                                                                                     reduction="none")
    return (loss * wts).sum(), z.argmax(-1)


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
    last = chunk.features[pos, -H:]
    flat = hidden.reshape(-1, H).to(head_w.dtype)
    labels, wts = chunk.labels.reshape(-1)[sel], chunk.weights.reshape(-1)[sel].float()
    markov, conf = model.markov_head, getattr(model, "confidence_head", None)
    loss = hidden.new_zeros((), dtype=torch.float32)
    pred = torch.full((A * B,), -1, dtype=torch.long, device=hidden.device)
    for i in range(0, sel.numel(), chunk.rows):
        j = min(sel.numel(), i + chunk.rows)
        part, arg = checkpoint(_rows_loss, flat[sel[i:j]], markov.embed(prev[i:j]), last[i:j], labels[i:j],
                               wts[i:j], head_w, markov.markov_w2.weight, conf, options, use_reentrant=False)
        loss = loss + part
        pred[sel[i:j]] = arg
    return loss, pred.view(A, B)


def slot_metrics(pred: torch.Tensor, labels: torch.Tensor):
    """(correct (B,), accept_sum) of every slot's drafts: each slot is a draft (anchor as first)."""
    valid = labels >= 0
    hit = (pred == labels) & valid
    return hit.sum(0), accepted_lengths(hit).sum()
