"""The DFlash 2 selector's term of the objective and the metrics read along the selector's path.

Loss (teacher-forced, as speculators PR 1006 and SpecForge PR 772 train it): at every trained slot k the
candidates are the unary head's top-K there, with the gold token put in place of the K-th when the top-K
misses it (only in the loss's set: the walk and the metrics keep what serving sees); the predecessor is
the gold token of slot k - 1 (the anchor token at k = 1); the term is the K-way cross-entropy of the pair
scores S_k(gold_{k-1}, .) against the gold, weighted by the slot's position weight, so it adds to the
unary loss's sum and shares its normalisation. Why this one: it trains exactly the scores the served walk
reads (U + the pair term, over the served candidate set), costs K x R per row (no vocabulary-sized
tensor), and the gold insertion keeps a gradient on the rows the top-K misses instead of dropping them
(which would be an uncounted skip of the hardest rows). `variant.selector_detach` stops its gradient
into the backbone (SpecForge PR 793's option): the selector then trains on the DFlash features alone.

Cost: the top-K and its logits come off the LM head loss's own logits (`lm_head_loss(top_k=K)`), the loss
and the metrics share them, and the walk scores only its chosen predecessor's row at each position
(`CandidateSelector.greedy_path`): beside the DFlash step this adds a topk per labelled row, no pass of
the head but for the label-less slots the walk passes (docs/benchmarks.md, "DFlash 2 step time").

Metrics: `correct` and `accept_sum` follow the greedy walk over the served top-K (what vLLM drafts);
the unary head's own (argmax) figures come beside them as `unary_*`, and the top-K's recall of the gold
per slot as `topk_hits` (TorchSpec issue 177: an acceptance read off the unary head hides the selector).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_dist.models.variants.base import accepted_lengths
from dflash_dist.models.variants.dflash2.modules import candidate_logits, unary_top_k, unary_values


@dataclass
class SelectorMetrics:
    loss_sum: torch.Tensor  # sum of w * ce of the selector term (before its weight alpha)
    correct: torch.Tensor  # (B,) hits of the walk per slot
    accept_sum: torch.Tensor  # accepted prefix (+1) of the walk, summed over blocks
    topk_hits: torch.Tensor  # (B,) trained slots whose gold is in the served top-K


def _previous_tokens(input_ids, anchors, labels) -> torch.Tensor:
    """(A, B-1) the gold token before each drafted slot 1..B-1: the anchor's at slot 1, the label of slot
    k - 1 after (the data's token where that slot is untrained, e.g. a prompt token)."""
    B = labels.shape[1]
    pos = (anchors[:, None] + torch.arange(B - 1, device=anchors.device)).clamp(max=input_ids.numel() - 1)
    data = input_ids[pos]
    return torch.where(labels[:, :-1] >= 0, labels[:, :-1], data)


def _with_gold(ids: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(candidates with the gold in the last column where the top-K misses it, the gold's column, hit)."""
    match = ids == gold[:, None]
    hit = match.any(-1)
    ids = ids.clone()
    ids[~hit, -1] = gold[~hit]
    col = torch.where(hit, match.float().argmax(-1), torch.full_like(gold, ids.shape[1] - 1))
    return ids, col, hit


def _walked_rows(lab: torch.Tensor) -> torch.Tensor:
    """(A, S) the drafted slots without a label that the walk passes before one with a label (a loss-mask
    gap inside a block): their candidates steer the path the metrics read. Slots after a block's last
    label steer nothing that is counted, so they need none."""
    trained = lab >= 0
    return (trained.flip(1).cumsum(1).flip(1) > 0) & ~trained


def selector_term(model, hidden: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                  labels: torch.Tensor, weights: torch.Tensor, top, *, detach: bool = False,
                  rows: int = 8192) -> tuple[torch.Tensor, SelectorMetrics]:
    """hidden (A, B, H): final-normed drafter states of the blocks at `anchors`; labels/weights (A, B) of
    the objective; top: the head's top-K at the n slots with a label (`lm_head_loss(..., top_k=K)`'s, read
    off the loss's logits). Returns (sum of w * ce, differentiable; metrics on the device)."""
    s, sel_mod, head = model.spec.options, model.candidate_selector, model.lm_head.weight
    A, B, H = hidden.shape
    S, K = B - 1, s.selector_top_k
    h = hidden[:, 1:].to(head.dtype)  # the drafted slots 1..B-1 (slot 0 never has a label)
    lab, wts = labels[:, 1:], weights[:, 1:]
    prev = _previous_tokens(input_ids, anchors, labels)
    flat = h.reshape(-1, H)
    rsel = torch.nonzero(lab.reshape(-1) >= 0).squeeze(1)
    if top.ids.shape != (rsel.numel(), K):
        raise ValueError(f"selector_term: top-K ids {tuple(top.ids.shape)} must be (rows with a label, K) = "
                         f"({rsel.numel()}, {K})")
    gold = lab.reshape(-1)[rsel]
    ids, col, hit = _with_gold(top.ids, gold)
    hl = flat[rsel].detach() if detach else flat[rsel]
    # The candidates' logits are the loss's (the gold's where it took the K-th place): only the backward
    # gathers head rows.
    z = top.logits.clone()
    z[~hit, -1] = top.label_logits[~hit]
    unary = unary_values(candidate_logits(hl, head, ids, rows, values=z), s.output_multiplier,
                         s.final_logit_softcapping)
    scores = sel_mod.scores_after(prev.reshape(-1)[rsel], ids, unary, sel_mod.project(hl))  # (n, K)
    ce = F.cross_entropy(scores, col, reduction="none")
    loss_sum = (ce * wts.reshape(-1)[rsel].float()).sum()
    with torch.no_grad():
        # The served candidates and their logits: the loss's top-K, and at the few label-less slots the
        # walk passes a pass of the head of their own.
        served = torch.zeros(A * S, K, dtype=torch.long, device=h.device)  # id 0: slots nothing reads
        served_z = torch.zeros(A * S, K, dtype=torch.float32, device=h.device)
        served[rsel], served_z[rsel] = top.ids, top.logits
        gap = torch.nonzero(_walked_rows(lab).reshape(-1)).squeeze(1)
        if gap.numel():
            served[gap] = unary_top_k(flat[gap], head, K, rows)
            served_z[gap] = candidate_logits(flat[gap], head, served[gap], rows)
        served_u = unary_values(served_z, s.output_multiplier, s.final_logit_softcapping)
        m = _path_metrics(model, h, served.view(A, S, K), served_u.view(A, S, K), anchors, input_ids, labels,
                          rsel, hit)
    return loss_sum, SelectorMetrics(loss_sum.detach(), *m)


def _path_metrics(model, h, served, unary, anchors, input_ids, labels, rsel, hit):
    """(correct (B,), accept_sum, topk_hits (B,)) of the greedy walk over the served candidates (A, S, K)
    with their unary scores."""
    A, S = h.shape[0], h.shape[1]
    path = model.candidate_selector.greedy_path(served, unary, h, input_ids[anchors])
    valid = labels >= 0
    hits = torch.zeros_like(valid)
    hits[:, 1:] = (path == labels[:, 1:]) & valid[:, 1:]
    run = accepted_lengths(hits[:, 1:])
    in_top = torch.zeros(A * S, dtype=torch.bool, device=h.device)
    in_top[rsel] = hit
    topk = torch.zeros_like(valid)
    topk[:, 1:] = in_top.view(A, S)
    return hits.sum(0), run.sum(), topk.sum(0)
