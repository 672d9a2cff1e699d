"""Greedy draft-then-verify decoding of one prompt on the target's KV cache (the hf engine's decoder).

One step: the last committed token is the anchor; the drafter sees the target's features of every
position before it and proposes the B-1 tokens after it in one forward; the target runs the anchor and
the draft on its cache in one forward (the verify); the longest draft prefix equal to the target's own
greedy choices is accepted, plus the target's token at the first disagreement (the bonus, the next
anchor); the cache is cut back to the committed positions, whose features become the drafter's new
context rows. So the output is token for token the target's greedy output, and each step commits
1..B tokens (its acceptance). The same loop on `RecomputeCache` is the full-recompute reference.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dflash_dist.models.attention import prepare_block_attention
from dflash_dist.models.decode import sequence_cache
from dflash_dist.models.qwen3 import apply_rope, rope_cos_sin


@dataclass
class Decoded:
    tokens: list[int]  # the new tokens, cut after a stop token or at max_new_tokens
    seconds: float  # wall time of the whole decode (prefill included)
    accepted: list[int] = field(default_factory=list)  # tokens committed by each verify step (1..B)


class ContextDrafter:
    """A DFlashDrafter with a cache of its context, as the engines keep one: each committed position's
    fused context row (fc + norm of its target features) and, per draft layer, its key (k_norm, RoPE at its
    position) and value are computed once; a proposal then runs only the block's B rows through the
    layers (`DraftLayer.over_context`, the context part read from that cache), and its tokens are the
    drafter's `block_tokens`: the unary argmax, or DFlash 2's selector walk (tests hold it to the
    full-recompute reference, step for step)."""

    def __init__(self, drafter, capacity: int):
        self.drafter, self.capacity, self.n = drafter, capacity, 0
        self.K: list[torch.Tensor] = []
        self.V: list[torch.Tensor] = []

    def add(self, feats: torch.Tensor) -> None:
        d, s = self.drafter, self.drafter.spec
        rows = d.context(feats)
        m = rows.shape[0]
        if not self.K:  # the context's dtype (bf16 under autocast): known at the first rows
            self.K = [rows.new_zeros(self.capacity, s.num_kv_heads, s.head_dim) for _ in d.layers]
            self.V = [rows.new_zeros(self.capacity, s.num_kv_heads, s.head_dim) for _ in d.layers]
        cos, sin = rope_cos_sin(torch.arange(self.n, self.n + m, device=rows.device), s.head_dim, s.rope_theta,
                                rows.dtype)
        for layer, K, V in zip(d.layers, self.K, self.V):
            a = layer.self_attn
            K[self.n:self.n + m], V[self.n:self.n + m] = apply_rope(a.k(rows), cos, sin), a.v(rows)
        self.n += m

    def propose(self, seq: Sequence[int]) -> list[int]:
        d, s = self.drafter, self.drafter.spec
        anchor, B, dev = len(seq) - 1, s.block_size, self.K[0].device
        ids = torch.full((1, B), s.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = seq[-1]
        x = d._embed(ids).to(self.K[0].dtype)
        rope = rope_cos_sin(anchor + torch.arange(B, device=dev)[None], s.head_dim, s.rope_theta, x.dtype)
        lo, hi = torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([anchor], device=dev)
        prepared = prepare_block_attention(lo, hi, anchor, 1, B, like=x)
        for layer, K, V in zip(d.layers, self.K, self.V):
            x = layer.over_context(x, K[:anchor], V[:anchor], rope, lo, hi, prepared)
        return d.block_tokens(d.norm(x), ids[:, 0])[0].tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finished(new: list[int], max_new: int, stop: frozenset) -> int | None:
    """Where the output ends (a stop token is kept), or None while it goes on."""
    for i, t in enumerate(new[:max_new]):
        if t in stop:
            return i + 1
    return max_new if len(new) >= max_new else None


@torch.no_grad()
def target_greedy(target, prompt: Sequence[int], max_new: int, stop: frozenset = frozenset(),
                  recompute: bool = False) -> Decoded:
    """The target alone, one token per forward on its cache: the reference output and the baseline time."""
    dev = target.embed_tokens.weight.device
    cache = sequence_cache(target, [0], len(prompt) + max_new + 1, recompute)
    _sync(dev)
    t0 = time.perf_counter()
    _, logits = cache.extend(list(prompt), keep=1)
    out: list[int] = []
    while True:
        out.append(int(logits[-1].argmax()))
        if _finished(out, max_new, stop) is not None:
            break
        _, logits = cache.extend(out[-1:], keep=1)
    _sync(dev)
    return Decoded(out, time.perf_counter() - t0)


@torch.no_grad()
def speculative(target, drafter, prompt: Sequence[int], max_new: int, stop: frozenset = frozenset(),
                recompute: bool = False, proposer=None) -> Decoded:
    """Draft-then-verify greedy decoding (module docstring). A step's acceptance counts whole even when
    the output is cut inside it (at max_new or a stop token), as the serving engines count it.
    `proposer(drafter, capacity)`: what drafts each block (`add(features)`, `propose(seq)`);
    `ContextDrafter` unless given (the tests' oracles bring their own)."""
    if not prompt:
        raise ValueError("speculative decoding needs a non-empty prompt")
    spec = drafter.spec
    B, dev = spec.block_size, target.embed_tokens.weight.device
    capacity = len(prompt) + max_new + B + 1
    draft = (proposer or ContextDrafter)(drafter, capacity)
    cache = sequence_cache(target, spec.target_layer_ids, capacity, recompute)
    _sync(dev)
    t0 = time.perf_counter()
    feats, logits = cache.extend(list(prompt), keep=1)
    draft.add(feats)
    seq = list(prompt) + [int(logits[-1].argmax())]  # the first anchor: the target's own next token
    accepted: list[int] = []
    while (end := _finished(seq[len(prompt):], max_new, stop)) is None:
        anchor = len(seq) - 1
        block = draft.propose(seq)
        feats, logits = cache.extend([seq[-1]] + block)  # positions anchor .. anchor + len(block)
        choice = logits.argmax(-1).tolist()  # the target's token for anchor + 1 .. anchor + len(block) + 1
        a = 0
        while a < len(block) and block[a] == choice[a]:  # B - 1 drafts, or B (anchor as first: DSpark)
            a += 1
        cache.crop(anchor + a + 1)  # the anchor and the accepted drafts stay; the rest was never said
        draft.add(feats[:a + 1])
        seq += block[:a] + [choice[a]]
        accepted.append(a + 1)
    _sync(dev)
    return Decoded(seq[len(prompt):len(prompt) + end], time.perf_counter() - t0, accepted)
