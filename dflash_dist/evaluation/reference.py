"""The full-recompute decoder: today's reference, kept independent of the cached engine it checks.

The target recomputes the whole sequence at every verify step (no KV cache) and the drafter gets the
raw features of the whole prefix: slow, simple and exact. Tests hold the hf engine (`speculative`) to
it, token for token and step for step.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dflash_dist.models.decode import recompute_greedy


def _run_target(target, ids: Sequence[int], layer_ids: Sequence[int]):
    """(features (n, F), logits (n, V)) of one sequence."""
    dev = target.embed_tokens.weight.device
    t = torch.tensor(list(ids), dtype=torch.long, device=dev)
    cu = torch.tensor([0, len(t)], dtype=torch.long, device=dev)
    return target.capture(t, cu, torch.arange(len(t), device=dev), list(layer_ids), need_logits=True)


def greedy_generate(target, prompt_ids: Sequence[int], n: int) -> list[int]:
    """The target's own greedy continuation of one prompt, by full recompute."""
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.embed_tokens.weight.device)
    return recompute_greedy(target, prompt, n)[0].tolist()


@torch.no_grad()
def propose_block(drafter, features: torch.Tensor, seq: Sequence[int]) -> list[int]:
    """The drafter's tokens after the anchor seq[-1] (B - 1, or B for DSpark), given target features of seq[:-1]."""
    anchor = len(seq) - 1
    dev = features.device
    # The anchor's own feature row is never attended (context is strictly before it): zeros fill it.
    feats = torch.cat([features[:anchor], features.new_zeros(1, features.shape[1])])
    ids = torch.tensor(list(seq), dtype=torch.long, device=dev)
    positions, anchors = torch.arange(anchor + 1, device=dev), torch.tensor([anchor], device=dev)
    # The whole forward (context of every row, no cache), then the drafter's own pick of tokens: the
    # unary argmax or DFlash 2's selector walk at temperature 0.
    hidden = drafter.draft_hidden(drafter.context(feats), ids, positions, anchors, torch.zeros_like(anchors))
    return drafter.block_tokens(hidden, ids[anchors])[0].tolist()


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids: Sequence[int], max_new_tokens: int,
                         propose=propose_block) -> tuple[list[int], list[int]]:
    """(max_new_tokens new tokens, accepted length of every verify step). Each step commits between 1
    and B tokens; the output is cut at max_new_tokens, the step's acceptance is counted whole.
    `propose(drafter, features, seq)`: `propose_block` unless given (the tests' oracles bring their own)."""
    layer_ids = list(drafter.spec.target_layer_ids)
    seq = [int(t) for t in prompt_ids]
    if not seq:
        raise ValueError("speculative_generate needs a non-empty prompt")
    feats, logits = _run_target(target, seq, layer_ids)
    seq.append(int(logits[-1].argmax()))  # the first anchor: the target's own next token
    accepted: list[int] = []
    while len(seq) - len(prompt_ids) < max_new_tokens:
        anchor = len(seq) - 1
        draft = propose(drafter, feats, seq)
        feats, logits = _run_target(target, seq + draft, layer_ids)
        choice = logits[anchor:anchor + len(draft) + 1].argmax(-1).tolist()  # target's token for anchor+1 ..
        a = 0
        while a < len(draft) and draft[a] == choice[a]:  # B - 1 drafts, or B (anchor as first: DSpark)
            a += 1
        # feats stay valid up to the new anchor: every position before it holds an accepted token.
        seq += draft[:a] + [choice[a]]
        accepted.append(a + 1)
    return seq[len(prompt_ids):][:max_new_tokens], accepted
