"""Greedy decoding by the target: the one decoder that regeneration and evaluation share.

`greedy(target, prompts, counts)` continues prompts of any lengths. The built-in target decodes a whole
batch of ragged prompts at once with a KV cache (each row at its own position); a transformers target
gets one batch per prompt length (no padding, so no attention mask) through its own cache
(`HFTarget.greedy`); anything else recomputes the sequence at every step through `capture`
(`recompute_greedy`), which is also the reference the others are tested against.

Speculative decoding needs a cache of one sequence that grows by a whole block and is cut back to the
accepted tokens: `sequence_cache` gives the target's (`TinyCache`, `HFCache` on transformers'
DynamicCache), or `RecomputeCache`, which recomputes everything (the reference).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.nn.functional as F

from dflash_dist.models.qwen3 import TinyQwen3, apply_rope, rope_cos_sin


@contextlib.contextmanager
def one_cpu_thread(device: torch.device):
    """Decoding a small model runs thousands of tiny ops: on CPU, intra-op threads only add
    synchronisation, and on a shared machine they made it up to ten times slower (measured on
    data.regenerate's synthetic path). One thread inside, the count restored afterwards; CUDA untouched."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _qkv(layer, x, cos, sin):
    a = layer.self_attn
    h = layer.input_layernorm(x)
    q = apply_rope(a.q(h), cos, sin).transpose(1, 2)  # (b, heads, t, d)
    return q, apply_rope(a.k(h), cos, sin).transpose(1, 2), a.v(h).transpose(1, 2)


def _finish(layer, x, attn):
    x = x + layer.self_attn.o_proj(attn.transpose(1, 2).flatten(-2))
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.no_grad()
def tiny_greedy(model: TinyQwen3, prompts: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
    """Greedy continuation of counts[r] tokens for every prompt (any lengths), decoding all rows at once
    with a KV cache (the same pre-norm layer as DecoderLayer.forward, one new token at a time). Each row
    writes its cache at its own position and masks the slots past it, so ragged prompts need no
    padding; rows run sorted by count, so the rows still decoding are always a prefix of the batch."""
    dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    order = sorted((r for r in range(len(prompts)) if counts[r] > 0), key=lambda r: -counts[r])
    result = [torch.zeros(0, dtype=torch.long, device=dev) for _ in prompts]
    if not order:
        return result
    b, n = len(order), counts[order[0]]
    live = [sum(counts[r] > s for r in order) for s in range(n)]  # rows still decoding at step s
    lens = torch.tensor([len(prompts[r]) for r in order], device=dev)
    total = int(lens.max()) + n
    cos_all, sin_all = rope_cos_sin(torch.arange(total, device=dev), model.head_dim, model.rope_theta, dtype)
    g, rep, d = model.num_kv_heads, model.num_heads // model.num_kv_heads, model.head_dim
    # Zeros, not empty: masked slots get probability 0, but 0 * (garbage NaN) in p @ V would be NaN.
    K = [torch.zeros(b, g, total, d, dtype=dtype, device=dev) for _ in model.layers]
    V = [torch.zeros(b, g, total, d, dtype=dtype, device=dev) for _ in model.layers]
    tok = torch.empty(b, dtype=torch.long, device=dev)
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(order):
        by_len[len(prompts[r])].append(i)
    for L, rows in by_len.items():  # prefill: causal, one batch per prompt length
        idx = torch.tensor(rows, device=dev)
        x = model.embed_tokens(torch.stack([prompts[order[i]] for i in rows]).to(dev))
        for layer, k_cache, v_cache in zip(model.layers, K, V):
            q, k, v = _qkv(layer, x, cos_all[:L], sin_all[:L])
            k_cache[idx, :, :L], v_cache[idx, :, :L] = k, v
            x = _finish(layer, x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1))
        tok[idx] = model.lm_head(model.norm(x[:, -1])).argmax(-1)
    out = torch.empty(b, n, dtype=torch.long, device=dev)
    out[:, 0] = tok
    # Cache slot t of row i, kv head j is flat index (i * g + j) * total + t.
    base = (torch.arange(b * g, device=dev) * total).view(b, g)
    pos = lens.clone()
    for s in range(1, n):  # row i's new token sits at pos[i] and sees cache slots [0, pos[i]]
        m = live[s]
        tok, pos = tok[:m], pos[:m]
        x = model.embed_tokens(tok)[:, None]
        cos, sin = cos_all[pos][:, None], sin_all[pos][:, None]
        width = int(pos.max()) + 1
        hide = (torch.arange(width, device=dev)[None, :] > pos[:, None])[:, None, None, :]
        slots = (base[:m] + pos[:, None]).flatten()
        for layer, k_cache, v_cache in zip(model.layers, K, V):
            q, k, v = _qkv(layer, x, cos, sin)
            k_cache.view(-1, d).index_copy_(0, slots, k.reshape(-1, d))
            v_cache.view(-1, d).index_copy_(0, slots, v.reshape(-1, d))
            # One query per row: plain matmuls beat the fused CPU attention kernel here by far.
            scores = q.view(m, g, rep, d) @ k_cache[:m, :, :width].transpose(-1, -2) * d ** -0.5
            p = torch.softmax(scores.masked_fill(hide, float("-inf")).float(), dim=-1).to(dtype)
            x = _finish(layer, x, (p @ v_cache[:m, :, :width]).view(m, model.num_heads, 1, d))
        tok = model.lm_head(model.norm(x[:, -1])).argmax(-1)
        out[:m, s] = tok
        pos = pos + 1
    for i, r in enumerate(order):
        result[r] = out[i, :counts[r]]
    return result


@torch.no_grad()
def recompute_greedy(target, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """Any target with `capture`: equal-length prompts (b, L), the whole batch recomputed, packed, at
    every step (slow, exact)."""
    b, L = prompts.shape
    seqs = prompts
    for t in range(n):
        width = L + t
        cu = torch.arange(b + 1, device=seqs.device) * width
        pos = torch.arange(width, device=seqs.device).repeat(b)
        _, logits = target.capture(seqs.reshape(-1), cu, pos, [0], need_logits=True)
        seqs = torch.cat([seqs, logits[cu[1:] - 1].argmax(-1)[:, None]], dim=1)
    return seqs[:, L:]


def greedy(target, prompts: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
    """Greedy continuation of counts[r] tokens for every prompt (any lengths). The built-in target
    decodes them all at once; other targets get one batch per prompt length (no padding, so no
    attention mask), run to the batch's largest count."""
    if target.kind == "tiny":
        return tiny_greedy(target, prompts, counts)
    dev = target.embed_tokens.weight.device
    result: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long, device=dev) for _ in prompts]
    by_len: dict[int, list[int]] = defaultdict(list)
    for r, p in enumerate(prompts):
        if counts[r] > 0:
            by_len[len(p)].append(r)
    for rows in by_len.values():
        batch, n = torch.stack([prompts[r] for r in rows]).to(dev), max(counts[r] for r in rows)
        gen = target.greedy(batch, n) if target.kind == "hf" else recompute_greedy(target, batch, n)
        for r, row in zip(rows, gen):
            result[r] = row[:counts[r]]
    return result


# -- One sequence on a KV cache that can be extended by several tokens and cut back (speculative decoding) --

class TinyCache:
    """The built-in target's KV cache of one sequence: `extend` runs new tokens after the cached ones and
    returns their (features at `layer_ids`, logits); `crop(n)` keeps the first n positions (the slots
    past n are simply overwritten by the next `extend`). The same pre-norm layer as DecoderLayer."""

    def __init__(self, model: TinyQwen3, layer_ids, capacity: int):
        dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.model, self.layer_ids, self.length = model, list(layer_ids), 0
        self.cos, self.sin = rope_cos_sin(torch.arange(capacity, device=dev), model.head_dim, model.rope_theta, dtype)
        shape = (1, model.num_kv_heads, capacity, model.head_dim)
        self.K = [torch.zeros(shape, dtype=dtype, device=dev) for _ in model.layers]
        self.V = [torch.zeros(shape, dtype=dtype, device=dev) for _ in model.layers]

    @torch.no_grad()
    def extend(self, ids: list[int], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(features (n, F), logits of the last `keep` rows (all when 0))."""
        m, p0, n = self.model, self.length, len(ids)
        if p0 + n > self.cos.shape[0]:
            raise ValueError(f"cache of {self.cos.shape[0]} positions cannot take {p0 + n}")
        dev = self.cos.device
        x = m.embed_tokens(torch.tensor([ids], dtype=torch.long, device=dev))
        cos, sin = self.cos[p0:p0 + n], self.sin[p0:p0 + n]
        # Query i (position p0 + i) sees every cached slot and the new ones up to itself.
        see = torch.arange(p0 + n, device=dev)[None, :] <= (p0 + torch.arange(n, device=dev))[:, None]
        wanted, captured = set(self.layer_ids), {}
        for i, (layer, K, V) in enumerate(zip(m.layers, self.K, self.V)):
            q, k, v = _qkv(layer, x, cos, sin)
            K[:, :, p0:p0 + n], V[:, :, p0:p0 + n] = k, v
            attn = F.scaled_dot_product_attention(q, K[:, :, :p0 + n], V[:, :, :p0 + n], attn_mask=see,
                                                  enable_gqa=m.num_heads != m.num_kv_heads)
            x = _finish(layer, x, attn)
            if i in wanted:
                captured[i] = x[0]
        self.length = p0 + n
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1), m.lm_head(m.norm(x[0, -keep:]))

    def crop(self, n: int) -> None:
        self.length = n


class HFCache:
    """The same for a transformers target, on the model's own DynamicCache (`crop` is its API). Features
    are the model's hidden_states[i + 1] (draft_spec never picks the last layer, whose state
    transformers returns after the final norm), i.e. what `capture` returns."""

    def __init__(self, target, layer_ids):
        import inspect

        from transformers import DynamicCache
        self.target, self.layer_ids, self.cache = target, list(layer_ids), DynamicCache()
        # transformers 5 renamed past_key_values to cache; take whichever this version has.
        self.kw = "cache" if "cache" in inspect.signature(target.hf.forward).parameters else "past_key_values"

    @torch.no_grad()
    def extend(self, ids: list[int], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.target.embed_tokens.weight.device
        out = self.target.hf(input_ids=torch.tensor([ids], dtype=torch.long, device=dev), use_cache=True,
                             output_hidden_states=True, logits_to_keep=keep, **{self.kw: self.cache})
        feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return feats, out.logits[0]

    def crop(self, n: int) -> None:
        drop = self.cache.get_seq_length() - n
        if drop > 0:
            self.cache.crop(-drop)  # a negative count removes that many last positions


class RecomputeCache:
    """No cache at all, for any target with `capture`: every `extend` recomputes the whole sequence (the
    reference the cached ones are tested against)."""

    def __init__(self, target, layer_ids):
        self.target, self.layer_ids, self.ids = target, list(layer_ids), []

    @torch.no_grad()
    def extend(self, ids: list[int], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        self.ids += list(ids)
        dev = self.target.embed_tokens.weight.device
        t = torch.tensor(self.ids, dtype=torch.long, device=dev)
        feats, logits = self.target.capture(t, torch.tensor([0, len(t)], device=dev), torch.arange(len(t), device=dev),
                                            self.layer_ids, need_logits=True)
        return feats[-len(ids):], logits[-(keep or len(ids)):]

    def crop(self, n: int) -> None:
        del self.ids[n:]


def sequence_cache(target, layer_ids, capacity: int, recompute: bool = False):
    """The fastest exact cache this target has (`recompute=True`: the reference)."""
    if recompute:
        return RecomputeCache(target, layer_ids)
    if target.kind == "tiny":
        return TinyCache(target, layer_ids, capacity)
    if target.kind == "hf":
        return HFCache(target, layer_ids)
    if target.kind == "recompute":
        return RecomputeCache(target, layer_ids)
    raise ValueError(f"a {target.kind!r} target does not decode (a drafter rank's head-only target)")
