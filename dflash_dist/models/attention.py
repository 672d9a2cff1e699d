"""Attention over packed (padding-free) batches: attention never crosses a sequence boundary.

Two ops; every caller goes through them, and `impl=` (or the backend's default) picks the path:
  packed_causal_attention(q, k, v, cu_seqlens)       target forward: causal inside each sequence
  packed_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end, prepared=)
                                                     drafter: the blocks of all sequences in one call;
                                                     `prepare_block_attention` builds what the chosen
                                                     path needs once per step (or anchor chunk), and
                                                     every draft layer reuses it
Paths:
  "ref"    loop over sequences (SDPA for the causal op; two score tensors and one softmax for the
           drafter's). Runs everywhere and defines correctness; every other path is tested equal to it.
  "sdpa"   drafter op: per run of at most SDPA_GROUP blocks of a sequence, one fused SDPA call over
           [context | those blocks] with a boolean mask (for the causal op "sdpa" is "ref").
  "flex"   torch's flex_attention with a block mask built here from the sequence bounds, so fully
           masked 128x128 tiles are skipped and fully visible ones skip the mask function. Compiled.
  "flash"  flash_attn.flash_attn_varlen_func (causal op only): CUDA, fp16/bf16, flash-attn installed.

Choice rule for "auto" (the default; DFLASH_ATTN=ref|sdpa|flex|flash|auto, read at each use, or
`backend.use(name)` overrides):
  causal op:  CUDA, fp16/bf16 and flash-attn importable -> flash; else CUDA and flex -> flex; else ref.
  drafter op: CUDA and flex -> flex; else sdpa.
Why, on CPU (docs/benchmarks.md, attention, for the figures): compiled flex ran slower than the SDPA
loop for the causal op and compiles slowly; uncompiled flex materialises every score. flash-attn has no drafter path: a block's keys are a prefix of its sequence's
context, and varlen key windows cannot overlap.

Compilation can fail (no C compiler, an inductor bug for a shape), and a backward compiles only at the
first backward. `warm_up` runs every flex path an op will take (forward, backward, no-grad) on small
shapes before the first collective; under "auto" a failure there gives the op its fallback (ref/sdpa)
for the rest of the process, with one warning; an explicit impl="flex" raises instead. Shapes: flex is
compiled with automatic dynamic shapes (dynamic=None); warm_up calls each op at two shapes that differ in
every size, so the one recompile to symbolic sizes happens there, and a third shape checks that no
further compile follows. Calls shorter than two 128-token tiles are padded to two, so no real batch
meets the size-1 specialisation that a compiled graph guards against. dynamic=True is not used: on this
torch (2.13) inductor's CPU flex template does not compile with it (a C++ error); the automatic route
compiled twice and then held (tests/integration/test_attention_compiled.py). `backend.compile_stats()` counts the compiled graphs.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    BlockMask = flex_attention = None

log = logging.getLogger(__name__)

IMPLS = ("auto", "ref", "sdpa", "flex", "flash")
OPS = ("causal", "block")
TILE = 128  # flex's sparse block size: the granularity at which tiles are skipped
MIN_TILES = 2  # flex calls are padded to at least this many tiles per side (no size-1 specialisation)
SDPA_GROUP = 32  # blocks per SDPA call in the drafter's "sdpa" path (bounds its memory: see _sdpa_block)


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flex_available() -> bool:
    return flex_attention is not None


def _causal_kernel(q: Tensor, k: Tensor, v: Tensor, block_mask: "BlockMask", enable_gqa: bool) -> Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def _block_kernel(q: Tensor, k: Tensor, v: Tensor, block_mask: "BlockMask", enable_gqa: bool) -> Tensor:
    # A separate function from _causal_kernel: torch.compile caches graphs per code object, so the two
    # ops (different mask functions) never evict or re-guard each other's graphs.
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (its own counter; read before and after our calls)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


@dataclass
class AttentionBackend:
    """The process's attention choices and flex state in one object (`backend` below is the one used).

    impl: None = DFLASH_ATTN at each use (else "auto"); compile_flex: False runs flex_attention eagerly,
    which materialises every score (tests and debugging only); failed: op -> why flex was given up for it
    (under "auto"); graphs: op -> graphs compiled by its flex calls; warmed: set by `warm_up`, after
    which every compile counts as late (a recompile in the middle of training)."""
    impl: str | None = None
    compile_flex: bool = True
    failed: dict[str, str] = field(default_factory=dict)
    graphs: dict[str, int] = field(default_factory=dict)
    late_graphs: int = 0
    warmed: bool = False
    warming: bool = False
    _kernels: dict[str, Callable] = field(default_factory=dict, repr=False)

    def use(self, impl: str | None) -> None:
        if impl is not None and impl not in IMPLS:
            raise ValueError(f"attention impl {impl!r}: expected one of {IMPLS}")
        self.impl = impl

    def default_impl(self) -> str:
        impl = self.impl or os.environ.get("DFLASH_ATTN", "auto")
        if impl not in IMPLS:
            raise ValueError(f"attention impl {impl!r} (DFLASH_ATTN or backend.use): expected one of {IMPLS}")
        return impl

    def flex_eligible(self, op: str, x: Tensor) -> bool:
        """Whether "auto" gives `op` the flex path on tensors like x."""
        return x.is_cuda and flex_available() and op not in self.failed

    def resolve(self, impl: str | None, op: str, x: Tensor) -> str:
        """The path `impl` (None = the default) means for op "causal" or "block" on tensors like x."""
        impl = impl or self.default_impl()
        if impl not in IMPLS:
            raise ValueError(f"attention impl {impl!r}: expected one of {IMPLS}")
        if impl == "auto":
            if x.is_cuda and op == "causal" and x.dtype in (torch.float16, torch.bfloat16) and flash_available():
                return "flash"
            if self.flex_eligible(op, x):
                return "flex"
            return "sdpa" if op == "block" else "ref"
        if impl == "sdpa" and op == "causal":
            return "ref"  # the causal reference is already one SDPA call per sequence
        if impl == "flash" and (op != "causal" or not x.is_cuda or not flash_available()):
            raise ValueError("attention impl 'flash' needs the causal op, CUDA tensors and flash-attn installed")
        if impl == "flex" and not flex_available():
            raise ValueError("attention impl 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        return impl

    def flex(self, op: str, q: Tensor, k: Tensor, v: Tensor, mask: "BlockMask") -> Tensor:
        """Run op's flex kernel (compiled once per process), counting the graphs it compiles."""
        if not self.compile_flex:
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        if op not in self._kernels:
            self._kernels[op] = torch.compile(_causal_kernel if op == "causal" else _block_kernel)
        before = _graphs_compiled()
        out = self._kernels[op](q, k, v, mask, q.shape[1] != k.shape[1])
        new = _graphs_compiled() - before
        if new:
            self.graphs[op] = self.graphs.get(op, 0) + new
            if self.warmed and not self.warming:
                self.late_graphs += new
                log.warning("flex attention (%s) compiled a new graph after the warm-up (shape %s, %s); "
                            "a compile here can stall collectives", op, tuple(q.shape), q.dtype)
        return out

    def fallback(self, impl: str | None, op: str, fast: Callable[[], Tensor], slow: Callable[[], Tensor]) -> Tensor:
        """Run the flex path; under "auto" a failure gives this op its fallback from now on, loudly (a
        prepared flex mask that outlived the failure, in the chunk's later layers, goes there too)."""
        if (impl or self.default_impl()) != "auto":
            return fast()
        if op in self.failed:
            return slow()
        try:
            return fast()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # a missing compiler or an unsupported shape: the fallback still works
            self.give_up(op, exc)
            return slow()

    def give_up(self, op: str, exc: BaseException) -> None:
        first = str(exc).splitlines()[0] if str(exc) else ""
        self.failed[op] = f"{type(exc).__name__}: {first[:200]}"
        log.warning("flex attention failed for the %s op (%s); using %s for it from now on", op,
                    self.failed[op], "sdpa" if op == "block" else "ref")

    def compile_stats(self) -> dict:
        """{"graphs": {op: n}, "late_graphs": n compiled after warm_up, "failed": {op: why}}."""
        return {"graphs": dict(self.graphs), "late_graphs": self.late_graphs, "failed": dict(self.failed)}


backend = AttentionBackend()


def resolve(impl: str | None, op: str, x: Tensor) -> str:
    return backend.resolve(impl, op, x)


# -- the target's causal attention ------------------------------------------------------------------

def packed_causal_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, impl: str | None = None,
                            max_seqlen: int | None = None) -> Tensor:
    """q: (N, h, d), k/v: (N, h_kv, d). Causal inside each sequence, never across. Returns (N, h, d).
    max_seqlen (the longest sequence) saves the flash path a host synchronisation when the caller knows it."""
    path = backend.resolve(impl, "causal", q)
    if path == "flash":
        return _flash_causal(q, k, v, cu_seqlens, max_seqlen)
    if path == "flex":
        return backend.fallback(impl, "causal", lambda: _flex_causal(q, k, v, cu_seqlens),
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


def _flash_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int | None) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = max_seqlen if max_seqlen is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)


def _flex_causal(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> Tensor:
    n, dev = q.shape[0], q.device
    cu = cu_seqlens.to(dev)
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), cu[1:] - cu[:-1], output_size=n)
    mask = interval_block_mask(cu[seq], torch.arange(1, n + 1, device=dev), None, None, kv_len=n,
                               min_len=MIN_TILES * TILE)
    return _flex("causal", q, k, v, mask)


# -- the drafter's block attention ------------------------------------------------------------------

@dataclass(frozen=True)
class PreparedBlockAttention:
    """What `packed_block_attention` needs besides q/k/v, built once per step or anchor chunk and shared
    by the draft layers (they all see the same blocks and bounds). Opaque to callers."""
    path: str  # "flex" | "sdpa" | "ref"
    impl: str | None  # as asked (None = default): decides whether a flex failure may fall back
    kv_len_ctx: int
    num_blocks: int
    block_size: int
    mask: "BlockMask | None" = None  # flex: the block mask over [context | blocks]
    runs: tuple[tuple[int, int, int, int], ...] | None = None  # sdpa/ref: (first, end, ctx_lo, ctx_hi)


def prepare_block_attention(ctx_start: Tensor, ctx_end: Tensor, kv_len_ctx: int, num_blocks: int, block_size: int,
                            like: Tensor, impl: str | None = None) -> PreparedBlockAttention:
    """Resolve the drafter op's path for tensors like `like` and build its mask (flex) or its runs of
    blocks (sdpa/ref: one host synchronisation here instead of one per layer). kv_len_ctx: rows of the
    packed context (N); num_blocks (A) and block_size (B): the shape of q (A, B, h, d)."""
    path = backend.resolve(impl, "block", like)
    common = dict(path=path, impl=impl, kv_len_ctx=kv_len_ctx, num_blocks=num_blocks, block_size=block_size)
    if path == "flex":
        try:
            return PreparedBlockAttention(**common, mask=_block_mask(ctx_start, ctx_end, kv_len_ctx, num_blocks,
                                                                     block_size, like.device))
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if (impl or backend.default_impl()) != "auto":
                raise
            backend.give_up("block", exc)
            common["path"] = path = "sdpa"
    return PreparedBlockAttention(**common, runs=_block_runs(ctx_start, ctx_end, SDPA_GROUP if path == "sdpa" else None))


def packed_block_attention(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_start: Tensor,
                           ctx_end: Tensor, impl: str | None = None,
                           prepared: PreparedBlockAttention | None = None) -> Tensor:
    """DFlash draft attention for the blocks of every sequence of a packed batch, in one call.

    q, k_blk, v_blk: (A, B, h|h_kv, d); k_ctx, v_ctx: (N, h_kv, d), the packed context of all
    sequences. Block j sees context rows [ctx_start[j], ctx_end[j]) (its sequence's start up to its
    anchor, exclusive) and its own B slots both ways. Returns (A, B, h, d). `prepared` (from
    `prepare_block_attention` with the same bounds and shapes) replaces `impl` and skips rebuilding the
    mask or the runs.
    """
    if prepared is None:
        prepared = prepare_block_attention(ctx_start, ctx_end, k_ctx.shape[0], q.shape[0], q.shape[1], q, impl)
    elif (prepared.kv_len_ctx, prepared.num_blocks, prepared.block_size) != (k_ctx.shape[0], *q.shape[:2]):
        raise ValueError(f"prepared block attention is for N={prepared.kv_len_ctx}, A={prepared.num_blocks}, "
                         f"B={prepared.block_size}; got N={k_ctx.shape[0]}, (A, B)={tuple(q.shape[:2])}")
    args = (q, k_ctx, v_ctx, k_blk, v_blk)
    if prepared.path == "flex":
        def sdpa():
            return _sdpa_block(*args, ctx_end, _block_runs(ctx_start, ctx_end, SDPA_GROUP))
        return backend.fallback(prepared.impl, "block", lambda: _flex_block(*args, prepared.mask), sdpa)
    if prepared.path == "sdpa":
        return _sdpa_block(*args, ctx_end, prepared.runs)
    return _ref_packed_block(*args, ctx_end, prepared.runs)


def _block_runs(ctx_start: Tensor, ctx_end: Tensor, longest: int | None) -> tuple[tuple[int, int, int, int], ...]:
    """(first, end, ctx_lo, ctx_hi) of each run of consecutive blocks sharing a context start, cut at
    `longest` blocks; the run's blocks see at most context rows [ctx_lo, ctx_hi)."""
    starts, ends = ctx_start.tolist(), ctx_end.tolist()
    return tuple((a, b, starts[a], max(ends[a:b])) for a, b in _runs(starts, longest))


def _runs(starts: list[int], longest: int | None = None) -> Iterator[tuple[int, int]]:
    a = 0
    while a < len(starts):
        b = a + 1
        while b < len(starts) and starts[b] == starts[a] and (longest is None or b - a < longest):
            b += 1
        yield a, b
        a = b


def _ref_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_len: Tensor) -> Tensor:
    """The blocks of ONE sequence: block j sees context rows [0, ctx_len[j]) and its own B slots. One
    softmax over two score tensors, (A, B, L) and (A, B, B), so memory grows with A*B*(L+B), not
    A*B*(L+A*B) as a dense mask over the concatenated keys would."""
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
    return torch.einsum("ahbl,lhd->abhd", p[..., :L], v_ctx) + torch.einsum("ahbc,achd->abhd", p[..., L:], v_blk)


def _ref_packed_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_end: Tensor,
                      runs: tuple[tuple[int, int, int, int], ...]) -> Tensor:
    """The per-sequence reference over each run of blocks that share a context start."""
    outs = [_ref_block(q[a:b], k_ctx[s:e], v_ctx[s:e], k_blk[a:b], v_blk[a:b], ctx_end[a:b] - s)
            for a, b, s, e in runs]
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def _sdpa_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_end: Tensor,
                runs: tuple[tuple[int, int, int, int], ...], fold_gqa: bool | None = None) -> Tensor:
    """Per run of at most SDPA_GROUP blocks of one sequence: one SDPA call over [context | the run's
    blocks] with a boolean mask. The price is scoring every block against the run's other blocks,
    which the group bounds at G*B extra keys per query.

    Memory. On CUDA the call is restricted to the fused memory-efficient kernel (it takes a mask; flash
    does not): it holds no (heads x queries x keys) scores or probabilities, where the math kernel would
    build 32 x 512 x 16,896 float32 = 1.1 GB per call and keep the probabilities for backward. Grouped
    query heads are folded into the batch dimension (fold_gqa: q as (h/h_kv, h_kv, rows, d) against k/v
    expanded without a copy), so q and k/v have equal head counts for every fused kernel. What autograd
    keeps per call, with G = SDPA_GROUP blocks of B slots and K_r <= L + G*B keys (L: the context up to
    the run's last anchor): the concatenated k/v (2 * K_r * h_kv * d elements) and the mask as a bias
    (G*B * K_r elements): 5 KiB per key at the reference shape (bf16, h 32, h_kv 8, d 128, B 16, G 32),
    <= 87 MB per call for a 16K-token sequence (+ q, output: 4 MB each). A chunk of C anchors makes at
    most C/G + (its sequences) calls per layer, so this path's saved memory follows the anchor chunk:
    <= 3.2 GB per layer for C = 1,024 anchors all in 16K-token sequences (34 calls), about half that on
    average (a run's keys end at its last anchor). On CPU the native GQA call is used (a 4-D call:
    with 3-D inputs CPU SDPA takes its unfused path, measured 3.5x slower).
    """
    A, B, h, d = q.shape
    h_kv = k_ctx.shape[1]
    rep = h // h_kv
    fold = (q.is_cuda if fold_gqa is None else fold_gqa) and rep > 1
    kernels = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if q.is_cuda else contextlib.nullcontext()
    outs = []
    with kernels:
        for a, b, s, e in runs:
            n_q = (b - a) * B
            sees_ctx = torch.arange(e - s, device=q.device) < (ctx_end[a:b] - s).repeat_interleave(B)[:, None]
            blk = torch.arange(n_q, device=q.device) // B
            mask = torch.cat([sees_ctx, blk[:, None] == blk[None, :]], 1)  # (n_q, K_r)
            qs = q[a:b].flatten(0, 1)  # (n_q, h, d)
            ks, vs = (torch.cat([c[s:e], x[a:b].flatten(0, 1)]).transpose(0, 1)[None]  # (1, h_kv, K_r, d)
                      for c, x in ((k_ctx, k_blk), (v_ctx, v_blk)))
            if fold:  # query head i reads kv head i // rep (repeat_interleave order, as enable_gqa)
                qf = qs.view(n_q, h_kv, rep, d).permute(2, 1, 0, 3)  # (rep, h_kv, n_q, d)
                o = F.scaled_dot_product_attention(qf, ks.expand(rep, -1, -1, -1), vs.expand(rep, -1, -1, -1),
                                                   attn_mask=mask)
                o = o.permute(2, 1, 0, 3).reshape(n_q, h, d)
            else:
                o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks, vs, attn_mask=mask,
                                                   enable_gqa=rep > 1)[0].transpose(0, 1)
            outs.append(o.unflatten(0, (b - a, B)))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


# -- flex plumbing ----------------------------------------------------------------------------------

def _block_mask(ctx_start: Tensor, ctx_end: Tensor, n: int, A: int, B: int, dev: torch.device) -> "BlockMask":
    blk = torch.repeat_interleave(torch.arange(A, device=dev), B)
    own = n + blk * B  # a block's own slots follow the whole context in the key sequence
    return interval_block_mask(ctx_start.to(dev)[blk], ctx_end.to(dev)[blk], own, own + B, kv_len=n + A * B,
                               min_len=MIN_TILES * TILE)


def _flex_block(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, mask: "BlockMask") -> Tensor:
    A, B = q.shape[:2]
    k = torch.cat([k_ctx, k_blk.flatten(0, 1)])
    v = torch.cat([v_ctx, v_blk.flatten(0, 1)])
    return _flex("block", q.flatten(0, 1), k, v, mask).unflatten(0, (A, B))


def interval_block_mask(lo1: Tensor, hi1: Tensor, lo2: Tensor | None, hi2: Tensor | None, kv_len: int,
                        tile: int = TILE, min_len: int = 0) -> "BlockMask":
    """BlockMask where query i sees keys [lo1[i], hi1[i]) and [lo2[i], hi2[i]) (the second optional).

    Built from the intervals in O(Q + tiles^2), never from a dense Q x K mask. A tile is "partial" when
    some query row of it overlaps some key of it, "full" when one interval covers all its keys for every
    row (then the kernel skips the mask function). A tile covered only by the two intervals together
    stays partial: correct, only slower; the callers' intervals never meet. Padded query rows and a
    short last key tile are never full, so the mask function alone decides at the edges. min_len: the
    mask's query and key lengths are at least this (extra query rows see nothing, extra keys are seen by
    nobody); `_flex` pads q/k/v to the mask's lengths.
    """
    dev, nq = lo1.device, lo1.numel()
    q_len, kv_len = max(nq, min_len), max(kv_len, min_len)
    pad = -nq % tile + (-(-q_len // tile) - -(-nq // tile)) * tile
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
                                    seq_lengths=(q_len, kv_len))


def _flex(op: str, q: Tensor, k: Tensor, v: Tensor, mask: "BlockMask") -> Tensor:
    """q: (Q, h, d), k/v: (K, h_kv, d) -> (Q, h, d) contiguous, in q's dtype (autocast's on CUDA). Pads
    q and k/v with zero rows up to the mask's lengths (nothing sees or is seen by them)."""
    dtype = torch.get_autocast_dtype("cuda") if q.is_cuda and torch.is_autocast_enabled("cuda") else q.dtype
    nq = q.shape[0]
    q_len, kv_len = mask.seq_lengths
    q = F.pad(q, (0, 0, 0, 0, 0, q_len - nq)) if q_len > nq else q
    if kv_len > k.shape[0]:
        k, v = (F.pad(t, (0, 0, 0, 0, 0, kv_len - t.shape[0])) for t in (k, v))
    q, k, v = (t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = backend.flex(op, q, k, v, mask)
    return out.squeeze(0).transpose(0, 1)[:nq].contiguous()


# -- warm-up ----------------------------------------------------------------------------------------

# Three packed layouts whose every size differs (tokens, anchors, tiles; each past MIN_TILES tiles), so
# the first compiles static shapes, the second recompiles with symbolic sizes, the third must compile
# nothing: (sequence lengths, anchors per sequence).
_WARM_SHAPES = (([200, 37, 300], [8, 2, 10]), ([500, 301, 120, 90], [15, 9, 4, 3]),
                ([700, 650, 333], [21, 19, 10]))


def _warm_inputs(lengths: list[int], anchors: list[int], block_size: int, heads: int, kv_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype):
    """Random (q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end, cu_seqlens) for a packed layout:
    `anchors[s]` evenly spaced anchors in sequence s, each with room for a whole block."""
    starts, ends, s0 = [], [], 0
    for L, a in zip(lengths, anchors):
        for p in torch.linspace(0, L - block_size, a).long().tolist():
            starts.append(s0)
            ends.append(s0 + p)
        s0 += L
    A, n = len(starts), sum(lengths)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    return (rnd(A, block_size, heads, head_dim), rnd(n, kv_heads, head_dim), rnd(n, kv_heads, head_dim),
            rnd(A, block_size, kv_heads, head_dim), rnd(A, block_size, kv_heads, head_dim),
            torch.tensor(starts, device=device), torch.tensor(ends, device=device), cu)


def _exercise(op: str, impl: str, shapes, block_size: int, heads: int, kv_heads: int, head_dim: int,
              device: torch.device, dtype: torch.dtype, autocast) -> list[int]:
    """Run `op` with `impl` on each layout as training runs it (causal: forward without grad; block:
    forward + backward, then forward without grad); returns the graphs compiled per layout."""
    compiled = []
    for lengths, anchors in shapes:
        before = sum(backend.graphs.values())
        q, kc, vc, kb, vb, st, en, cu = _warm_inputs(lengths, anchors, block_size, heads, kv_heads, head_dim,
                                                     device, dtype)
        if op == "causal":
            n = kc.shape[0]
            qc = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            with torch.no_grad():
                packed_causal_attention(qc, kc, vc, cu, impl=impl)
        else:
            leaves = [t.requires_grad_() for t in (q, kc, vc, kb, vb)]
            with autocast:
                out = packed_block_attention(*leaves, st, en, impl=impl)
            out.float().square().mean().backward()
            with torch.no_grad(), autocast:
                packed_block_attention(*(t.detach() for t in leaves), st, en, impl=impl)
        compiled.append(sum(backend.graphs.values()) - before)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return compiled


def warm_up(device: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int,
            block_size: int = 16, ops: tuple[str, ...] = OPS, impl: str | None = None,
            autocast_dtype: torch.dtype | None = None) -> dict:
    """Compile and check every attention path the ops will take, before the first collective.

    Runs each op at three small packed layouts with the model's heads and head size: the target's causal
    op forward without grad (the target is frozen), the drafter's block op forward + backward and then
    without grad, under autocast to `autocast_dtype` when given (as the drafter trains). Under "auto", a
    flex failure (compile, forward or backward) gives the op its fallback now, which is then exercised
    too; a failure of the fallback, or of an explicitly asked path, raises here, naming op and path.
    Returns {op: {"path", "seconds", "graphs" (compiled per layout; the last must be 0), "flex_error"
    (when it fell back)}}. Call it again for another dtype or autocast state (fp32 evaluation, say)."""
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"warm_up: unknown ops {sorted(unknown)}; expected some of {OPS}")
    like = torch.empty(0, device=device, dtype=dtype)
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    report = {}
    backend.warming = True
    try:
        for op in ops:
            t0 = time.perf_counter()
            path = backend.resolve(impl, op, like)
            entry: dict = {}
            args = (block_size, heads, kv_heads, head_dim, device, dtype, autocast)
            shapes = _WARM_SHAPES if path == "flex" else _WARM_SHAPES[:1]
            try:
                entry["graphs"] = _exercise(op, path, shapes, *args)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                if path != "flex" or (impl or backend.default_impl()) != "auto":
                    raise RuntimeError(f"attention warm-up: the {op} op's {path!r} path failed on {device} "
                                       f"({dtype}): {type(exc).__name__}: {exc}") from exc
                if op not in backend.failed:
                    backend.give_up(op, exc)
                entry["flex_error"] = backend.failed[op]
                path = backend.resolve(impl, op, like)
                try:
                    entry["graphs"] = _exercise(op, path, _WARM_SHAPES[:1], *args)
                except Exception as exc2:
                    raise RuntimeError(f"attention warm-up: flex failed for the {op} op ({entry['flex_error']}) "
                                       f"and its fallback {path!r} failed too: {type(exc2).__name__}: {exc2}") from exc2
            if path == "flex" and entry["graphs"][-1]:
                log.warning("attention warm-up: the %s op still compiled at its third layout (%s graphs); "
                            "expect recompiles during training", op, entry["graphs"])
            entry.update(path=path, seconds=time.perf_counter() - t0)
            report[op] = entry
            log.info("attention warm-up: %s op -> %s in %.1fs (graphs per layout %s)", op, path, entry["seconds"],
                     entry["graphs"])
    finally:
        backend.warming = False
    backend.warmed = True
    return report
