"""Attention over packed (padding-free) batches.

Reference paths: a loop over sequences with SDPA. They run everywhere and define correctness; faster
paths must be tested equal to them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_causal_attention(q, k, v, cu_seqlens):
    """q: (N, h, d), k/v: (N, h_kv, d). Causal inside each sequence, never across. Returns (N, h, d)."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=qs.shape[1] != ks.shape[1])
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


def block_context_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_len):
    """DFlash draft attention for the blocks of ONE sequence.

    q, k_blk, v_blk: (A, B, h|h_kv, d): A blocks of B slots. k_ctx, v_ctx: (L, h_kv, d): the sequence's
    fused target context. ctx_len: (A,) int: block j sees context positions [0, ctx_len[j]) (strictly
    before its anchor) and the B slots of its own block in both directions; never another block.

    Computed as one softmax over two score tensors, (A, B, L) and (A, B, B), so memory grows with
    A*B*(L+B), not A*B*(L+A*B) as a dense mask over the concatenated keys would.
    """
    A, B, h, d = q.shape
    rep = h // k_ctx.shape[1]
    if rep > 1:
        k_ctx, v_ctx = k_ctx.repeat_interleave(rep, 1), v_ctx.repeat_interleave(rep, 1)
        k_blk, v_blk = k_blk.repeat_interleave(rep, 2), v_blk.repeat_interleave(rep, 2)
    scale = d ** -0.5
    s_ctx = torch.einsum("abhd,lhd->ahbl", q, k_ctx) * scale  # (A, h, B, L)
    s_blk = torch.einsum("abhd,achd->ahbc", q, k_blk) * scale  # (A, h, B, B)
    L = k_ctx.shape[0]
    hidden = torch.arange(L, device=q.device)[None, :] >= ctx_len[:, None]  # (A, L)
    s_ctx = s_ctx.masked_fill(hidden[:, None, None, :], float("-inf"))
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.einsum("ahbl,lhd->abhd", p[..., :L], v_ctx) + torch.einsum("ahbc,achd->abhd", p[..., L:], v_blk)
    return out
