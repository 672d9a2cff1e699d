"""Attention over packed (padding-free) batches: attention never crosses a sequence boundary.

Three entry points; every caller goes through them, and `impl=` (or the module default) picks the path:
  packed_causal_attention(q, k, v, cu_seqlens)      target forward: causal inside each sequence
  block_context_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_len)
                                                    drafter, the blocks of ONE sequence
  packed_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end)
                                                    drafter, the blocks of ALL sequences in one call

Paths:
  "ref"    loop over sequences (SDPA for the causal op; two score tensors and one softmax for the
           drafter's). Runs everywhere and defines correctness; every other path is tested equal to it.
  "sdpa"   drafter op: per run of at most SDPA_GROUP blocks of a sequence, one fused SDPA call over
           [context | those blocks] with a boolean mask (for the causal op "sdpa" is "ref").
  "flex"   torch's flex_attention with a block mask built here from the sequence bounds, so fully
           masked 128x128 tiles are skipped and fully visible ones skip the mask function. Compiled.
  "flash"  flash_attn.flash_attn_varlen_func (causal op only): CUDA, fp16/bf16, flash-attn installed.

Choice rule for "auto" (the default; DFLASH_ATTN=ref|sdpa|flex|flash|auto or set_default_impl overrides):
  causal op:  CUDA, fp16/bf16 and flash-attn importable -> flash; else CUDA and flex -> flex; else ref.
  drafter op: CUDA and flex -> flex; else sdpa.
Why, on CPU (docs/benchmarks.md, attention): compiled flex ran slower than the SDPA loop for the causal
op, has no backward (the drafter trains), and takes 20-40 s to compile per shape; uncompiled flex
materialises every score. The drafter's "sdpa" beat "ref" there because the reference allocates ~10
temporaries of A*h*B*L. flash-attn has no drafter path: a block's keys are a prefix of its sequence's
context, and varlen key windows cannot overlap. If flex fails under "auto" (no compiler, say), the op
falls back to ref/sdpa with one warning; an explicit impl="flex" raises instead.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    BlockMask = flex_attention = None

log = logging.getLogger(__name__)

IMPLS = ("auto", "ref", "sdpa", "flex", "flash")
TILE = 128  # flex's sparse block size: the granularity at which tiles are skipped
SDPA_GROUP = 32  # blocks per SDPA call in the drafter's "sdpa" path
_default = os.environ.get("DFLASH_ATTN", "auto")
# False runs flex_attention uncompiled, which materialises every score: tests and debugging only.
flex_compile = True
_flex_compiled = None
_flex_failed = False


def set_default_impl(name: str) -> None:
    global _default
    if name not in IMPLS:
        raise ValueError(f"attention impl {name!r}: expected one of {IMPLS}")
    _default = name


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flex_available() -> bool:
    return flex_attention is not None


def resolve(impl: str | None, op: str, x: torch.Tensor) -> str:
    """The path `impl` (None = module default) means for op "causal" or "block" on tensors like x."""
    impl = impl or _default
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r}: expected one of {IMPLS}")
    if impl == "auto":
        if x.is_cuda and op == "causal" and x.dtype in (torch.float16, torch.bfloat16) and flash_available():
            return "flash"
        if x.is_cuda and flex_available() and not _flex_failed:
            return "flex"
        return "sdpa" if op == "block" else "ref"
    if impl == "sdpa" and op == "causal":
        return "ref"  # the causal reference is already one SDPA call per sequence
    if impl == "flash" and (op != "causal" or not x.is_cuda or not flash_available()):
        raise ValueError("attention impl 'flash' needs the causal op, CUDA tensors and flash-attn installed")
    if impl == "flex" and not flex_available():
        raise ValueError("attention impl 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    return impl


# -- the target's causal attention ------------------------------------------------------------------

def packed_causal_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, impl: str | None = None) -> Tensor:
    """q: (N, h, d), k/v: (N, h_kv, d). Causal inside each sequence, never across. Returns (N, h, d)."""
    path = resolve(impl, "causal", q)
    if path == "flash":
        return _flash_causal(q, k, v, cu_seqlens)
    if path == "flex":
        return _with_fallback(impl, lambda: _flex_causal(q, k, v, cu_seqlens),
                              lambda: _ref_causal(q, k, v, cu_seqlens))
    return _ref_causal(q, k, v, cu_seqlens)


def _ref_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=qs.shape[1] != ks.shape[1])
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


def _flash_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)


def _flex_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    n, dev = q.shape[0], q.device
    cu = cu_seqlens.to(dev)
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), cu[1:] - cu[:-1], output_size=n)
    mask = interval_block_mask(cu[seq], torch.arange(1, n + 1, device=dev), None, None, kv_len=n)
    return _flex(q, k, v, mask)


# -- the drafter's block attention ------------------------------------------------------------------

def block_context_attention(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_len: Tensor,
                            impl: str | None = None) -> Tensor:
    """DFlash draft attention for the blocks of ONE sequence.

    q, k_blk, v_blk: (A, B, h|h_kv, d): A blocks of B slots. k_ctx, v_ctx: (L, h_kv, d): the sequence's
    fused target context. ctx_len: (A,) int: block j sees context positions [0, ctx_len[j]) (strictly
    before its anchor) and the B slots of its own block in both directions; never another block.
    """
    if resolve(impl, "block", q) != "ref":
        start = torch.zeros_like(ctx_len)
        return packed_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, start, ctx_len, impl=impl)
    return _ref_block(q, k_ctx, v_ctx, k_blk, v_blk, ctx_len)


def _ref_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_len: Tensor) -> Tensor:
    """One softmax over two score tensors, (A, B, L) and (A, B, B), so memory grows with A*B*(L+B),
    not A*B*(L+A*B) as a dense mask over the concatenated keys would."""
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


def packed_block_attention(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_start: Tensor,
                           ctx_end: Tensor, impl: str | None = None) -> Tensor:
    """DFlash draft attention for the blocks of every sequence of a packed batch, in one call.

    q, k_blk, v_blk: (A, B, h|h_kv, d); k_ctx, v_ctx: (N, h_kv, d), the packed context of all
    sequences. Block j sees context rows [ctx_start[j], ctx_end[j]) (its sequence's start up to its
    anchor, exclusive) and its own B slots both ways. Returns (A, B, h, d).
    """
    path = resolve(impl, "block", q)
    if path == "flex":
        return _with_fallback(impl, lambda: _flex_block(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end),
                              lambda: _sdpa_block(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end))
    if path == "sdpa":
        return _sdpa_block(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end)
    return _ref_packed_block(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end)


def _runs(starts: list[int], longest: int | None = None) -> Iterator[tuple[int, int]]:
    """(first, end) of each run of consecutive blocks sharing a context start, cut at `longest` blocks."""
    a = 0
    while a < len(starts):
        b = a + 1
        while b < len(starts) and starts[b] == starts[a] and (longest is None or b - a < longest):
            b += 1
        yield a, b
        a = b


def _ref_packed_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_start: Tensor,
                      ctx_end: Tensor) -> Tensor:
    """The per-sequence reference over each run of blocks that share a context start."""
    starts, ends = ctx_start.tolist(), ctx_end.tolist()
    outs = []
    for a, b in _runs(starts):
        s, e = starts[a], max(ends[a:b])
        outs.append(_ref_block(q[a:b], k_ctx[s:e], v_ctx[s:e], k_blk[a:b], v_blk[a:b], ctx_end[a:b] - s))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def _sdpa_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_start: Tensor,
                ctx_end: Tensor, group: int = SDPA_GROUP) -> Tensor:
    """Per run of at most `group` blocks: one fused SDPA call over [context | the run's blocks] with a
    boolean mask. Few large temporaries (the reference makes ~10 of size A*h*B*L, and fresh memory is
    what CPU time goes to); the price is scoring every block against the run's other blocks, which the
    group size bounds at group*B keys per query."""
    A, B, h, d = q.shape
    starts, ends = ctx_start.tolist(), ctx_end.tolist()
    outs = []
    for a, b in _runs(starts, group):
        s, e = starts[a], max(ends[a:b])
        n_q = (b - a) * B
        sees_ctx = torch.arange(e - s, device=q.device) < (ctx_end[a:b] - s).repeat_interleave(B)[:, None]
        blk = torch.arange(n_q, device=q.device) // B
        mask = torch.cat([sees_ctx, blk[:, None] == blk[None, :]], 1)
        # 4-D (1, heads, tokens, d): with 3-D inputs CPU SDPA takes its unfused path (measured 3.5x slower).
        qs = q[a:b].flatten(0, 1).transpose(0, 1)[None]
        ks, vs = (torch.cat([c[s:e], x[a:b].flatten(0, 1)]).transpose(0, 1)[None]
                  for c, x in ((k_ctx, k_blk), (v_ctx, v_blk)))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=h != ks.shape[1])
        outs.append(o[0].transpose(0, 1).unflatten(0, (b - a, B)))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def _flex_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_start: Tensor,
                ctx_end: Tensor) -> Tensor:
    A, B, h, d = q.shape
    n, dev = k_ctx.shape[0], q.device
    blk = torch.repeat_interleave(torch.arange(A, device=dev), B)
    own = n + blk * B  # a block's own slots follow the whole context in the key sequence
    mask = interval_block_mask(ctx_start.to(dev)[blk], ctx_end.to(dev)[blk], own, own + B, kv_len=n + A * B)
    k = torch.cat([k_ctx, k_blk.flatten(0, 1)])
    v = torch.cat([v_ctx, v_blk.flatten(0, 1)])
    return _flex(q.flatten(0, 1), k, v, mask).unflatten(0, (A, B))


# -- flex plumbing ----------------------------------------------------------------------------------

def interval_block_mask(lo1: Tensor, hi1: Tensor, lo2: Tensor | None, hi2: Tensor | None, kv_len: int,
                        tile: int = TILE) -> "BlockMask":
    """BlockMask where query i sees keys [lo1[i], hi1[i]) and [lo2[i], hi2[i]) (the second optional).

    Built from the intervals in O(Q + tiles^2), never from a dense Q x K mask. A tile is "partial" when
    some query row of it overlaps some key of it, "full" when one interval covers all its keys for every
    row (then the kernel skips the mask function). A tile covered only by the two intervals together
    stays partial: correct, only slower; the callers' intervals never meet. Padded query rows and a
    short last key tile are never full, so the mask function alone decides at the edges.
    """
    dev, nq = lo1.device, lo1.numel()
    pad = -nq % tile
    qt, kt = (nq + pad) // tile, -(-kv_len // tile)
    zero = torch.zeros(pad, dtype=torch.long, device=dev)
    ivals = [(torch.cat([lo.long(), zero]), torch.cat([hi.long(), zero]))
             for lo, hi in ((lo1, hi1), (lo2, hi2)) if lo is not None]
    rows = torch.arange(qt * tile, device=dev) // tile
    # any: +1 at a row's first overlapped tile, -1 after its last; a prefix sum counts the rows that touch.
    touch = torch.zeros(qt, kt + 1, dtype=torch.int32, device=dev)
    full = torch.zeros(qt, kt, dtype=torch.bool, device=dev)
    cols = torch.arange(kt, device=dev)
    for lo, hi in ivals:
        ok = hi > lo
        ones = ok.to(torch.int32)
        touch.index_put_((rows, torch.where(ok, lo // tile, 0)), ones, accumulate=True)
        touch.index_put_((rows, torch.where(ok, (hi - 1) // tile + 1, 0)), -ones, accumulate=True)
        # full: inside every row's interval: [max ceil(lo/tile), min floor(hi/tile)) over the tile's rows.
        first = torch.where(ok, -(-lo // tile), kt).view(qt, tile).amax(1)
        end = torch.where(ok, hi // tile, 0).view(qt, tile).amin(1)
        full |= (cols >= first[:, None]) & (cols < end[:, None])
    any_ = touch.cumsum(1)[:, :kt] > 0
    partial = any_ & ~full

    def as_blocks(m):
        idx = torch.argsort((~m).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return m.sum(1, dtype=torch.int32)[None, None], idx[None, None]

    (lo_a, hi_a), (lo_b, hi_b) = ivals[0], (ivals[1] if len(ivals) > 1 else (zero[:0], zero[:0]))
    two = len(ivals) > 1

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (kv_idx >= lo_a[q_idx]) & (kv_idx < hi_a[q_idx])
        if two:
            seen = seen | ((kv_idx >= lo_b[q_idx]) & (kv_idx < hi_b[q_idx]))
        return seen

    return BlockMask.from_kv_blocks(*as_blocks(partial), *as_blocks(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(nq, kv_len))


def _flex_fn():
    global _flex_compiled
    if not flex_compile:
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention)
    return _flex_compiled


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: "BlockMask") -> Tensor:
    """q: (Q, h, d), k/v: (K, h_kv, d) -> (Q, h, d) contiguous, in q's dtype (autocast's on CUDA)."""
    dtype = torch.get_autocast_dtype("cuda") if q.is_cuda and torch.is_autocast_enabled("cuda") else q.dtype
    q, k, v = (t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = _flex_fn()(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1).contiguous()


def _with_fallback(impl: str | None, fast: Callable[[], Tensor], ref: Callable[[], Tensor]) -> Tensor:
    """Run the flex path; under "auto" a compile failure falls back to the reference once, loudly."""
    global _flex_failed
    if (impl or _default) != "auto":
        return fast()
    try:
        return fast()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a missing compiler or an unsupported shape: the reference still works
        _flex_failed = True
        log.warning("flex attention failed (%s: %s); using the reference path from now on",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return ref()
