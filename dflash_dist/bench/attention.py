"""Packed (variable-length) attention paths against each other and against padded batches.

    python -m dflash_dist.bench.attention                       # CPU-sized shapes
    python -m dflash_dist.bench.attention --preset qwen3-8b     # GPU: 49,152 tokens, 32/8 heads x 128

Two ops, as the training run calls them:
  target  causal attention of the target forward over a packed batch (forward only, no grad)
  drafter DFlash block attention over all anchors of the batch (forward, and forward+backward where
          the path has a backward: flex has none on CPU)
Paths: "ref", "sdpa" (drafter only), "flex", "flash" (dflash_dist.models.attention) and "padded": the
batch padded to its longest sequence (drafter: and to the most anchors) and one SDPA call with a boolean
causal+padding mask, as a padded trainer would run it. Padding/unpadding is done once per batch in a
real model, so it is left out of the timed call. The table gives time per call (median, paths
interleaved), speed relative to "ref", tokens computed against real tokens (the padding waste) and
max |out - ref| on these shapes.
"""
from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from dflash_dist.bench.common import time_interleaved
from dflash_dist.bench.jobs import check_outputs, write_json
from dflash_dist.config import ranged
from dflash_dist.models import attention as attn


@dataclass(frozen=True)
class Shape:
    tokens: int
    min_len: int
    max_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    anchors: int  # per sequence, at most
    block: int


PRESETS = {
    "cpu": Shape(4096, 16, 1024, 8, 2, 64, "float32", 16, 16),
    "qwen3-8b": Shape(49152, 64, 4096, 32, 8, 128, "bfloat16", 512, 16),
    "tiny": Shape(256, 1, 64, 4, 2, 16, "float32", 4, 4),
}


def sample_lengths(s: Shape, gen: torch.Generator) -> list[int]:
    """Uniform lengths until the token budget is met; the last one is cut to fill it exactly."""
    out: list[int] = []
    while sum(out) < s.tokens:
        out.append(int(torch.randint(s.min_len, s.max_len + 1, (1,), generator=gen)))
    out[-1] -= sum(out) - s.tokens
    return [x for x in out if x > 0]


def sample_anchors(lengths: list[int], s: Shape, gen: torch.Generator) -> list[list[int]]:
    """Per sequence: sorted anchor positions p with room for a whole block (p + B <= len)."""
    out = []
    for L in lengths:
        room = max(0, L - s.block + 1)
        out.append(sorted(torch.randperm(room, generator=gen)[:s.anchors].tolist()))
    return out


def pad_causal(q, k, v, lengths):
    """(S, h, Lmax, d) tensors and the (S, 1, Lmax, Lmax) causal & key-padding mask."""
    S, Lmax = len(lengths), max(lengths)
    dev = q.device
    pos = torch.arange(Lmax, device=dev)
    valid = pos[None, :] < torch.tensor(lengths, device=dev)[:, None]  # (S, Lmax)

    def pad(t):
        out = t.new_zeros(S, Lmax, *t.shape[1:])
        out[valid] = t
        return out.transpose(1, 2).contiguous()

    mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]
    return pad(q), pad(k), pad(v), mask[:, None], valid


def pad_block(q, k_ctx, v_ctx, k_blk, v_blk, lengths, anchors, B):
    """Per sequence, [context padded to Lmax | blocks padded to Amax] as keys, and the dense mask."""
    S, Lmax, Amax = len(lengths), max(lengths), max(len(a) for a in anchors)
    dev = q.device
    pos = torch.arange(Lmax, device=dev)
    ctx_valid = pos[None, :] < torch.tensor(lengths, device=dev)[:, None]  # (S, Lmax)
    blk_valid = torch.arange(Amax, device=dev)[None, :] < torch.tensor([len(a) for a in anchors], device=dev)[:, None]
    anchor_pos = torch.zeros(S, Amax, dtype=torch.long, device=dev)
    anchor_pos[blk_valid] = torch.tensor([p for a in anchors for p in a], device=dev, dtype=torch.long)

    def pad(t, valid, n):  # t: (rows, ..., h, d) of valid rows -> (S, h, n * rest, d)
        out = t.new_zeros(S, n, *t.shape[1:])
        out[valid] = t
        return out.flatten(1, -3).transpose(1, 2).contiguous()

    qp = pad(q, blk_valid, Amax)
    kp = torch.cat([pad(k_ctx, ctx_valid, Lmax), pad(k_blk, blk_valid, Amax)], 2)
    vp = torch.cat([pad(v_ctx, ctx_valid, Lmax), pad(v_blk, blk_valid, Amax)], 2)
    row_blk = torch.arange(Amax * B, device=dev) // B
    sees_ctx = pos[None, None, :] < anchor_pos.repeat_interleave(B, 1)[:, :, None]  # (S, Amax*B, Lmax)
    sees_blk = (row_blk[:, None] == row_blk[None, :]).expand(S, -1, -1)
    mask = torch.cat([sees_ctx, sees_blk], 2)[:, None]
    return qp, kp, vp, mask, blk_valid


def available_impls(dev: torch.device, dtype: torch.dtype, requested: list[str] | None) -> list[str]:
    impls = ["ref", "sdpa", "padded"]
    if attn.flex_available():
        impls.append("flex")
    if dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and attn.flash_available():
        impls.append("flash")
    return [i for i in impls if requested is None or i in requested]


def bench_target(s, dev, dtype, lengths, impls, reps, warmup) -> list[dict]:
    n = s.tokens
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, s.head_dim, generator=g).to(dev, dtype) for h in (s.heads, s.kv_heads, s.kv_heads))
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0)
    qp, kp, vp, mask, valid = pad_causal(q, k, v, lengths)
    gqa = s.heads != s.kv_heads
    outs: dict[str, torch.Tensor] = {}

    def packed(impl):
        def run():
            outs[impl] = attn.packed_causal_attention(q, k, v, cu, impl=impl)
        return run

    def padded():
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=gqa)
        outs["padded"] = o

    # "sdpa" is the drafter op's path; for the causal op it is the reference itself.
    fns = {i: (padded if i == "padded" else packed(i)) for i in impls if i != "sdpa"}
    with torch.no_grad():
        med = time_interleaved(fns, reps, warmup, dev)
    if "padded" in outs:
        outs["padded"] = outs["padded"].transpose(1, 2)[valid]
    computed = {"padded": len(lengths) * max(lengths)}
    return rows("target causal", "fwd", med, outs, n, computed)


def bench_drafter(s, dev, dtype, lengths, impls, reps, warmup, backward: bool) -> list[dict]:
    B, n, d = s.block, s.tokens, s.head_dim
    g = torch.Generator().manual_seed(2)
    anchors = sample_anchors(lengths, s, g)
    A = sum(len(a) for a in anchors)
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    starts = torch.tensor([cu[i] for i, a in enumerate(anchors) for _ in a], device=dev)
    ends = torch.tensor([cu[i] + p for i, a in enumerate(anchors) for p in a], device=dev)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_(backward)

    q, kb, vb = rnd(A, B, s.heads, d), rnd(A, B, s.kv_heads, d), rnd(A, B, s.kv_heads, d)
    kc, vc = rnd(n, s.kv_heads, d), rnd(n, s.kv_heads, d)
    with torch.no_grad():
        padded_in = pad_block(q, kc, vc, kb, vb, lengths, anchors, B)
    qp, kp, vp = (t.detach().requires_grad_(backward) for t in padded_in[:3])
    mask, blk_valid = padded_in[3:]
    weight = torch.randn(A, B, s.heads, d, generator=g).to(dev, dtype)
    outs: dict[str, torch.Tensor] = {}

    def finish(name, packed_out):
        outs[name] = packed_out.detach()
        if backward:
            (packed_out * weight).sum().backward()

    def packed(impl):
        return lambda: finish(impl, attn.packed_block_attention(q, kc, vc, kb, vb, starts, ends, impl=impl))

    def padded():
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=s.heads != s.kv_heads)
        S, Amax = blk_valid.shape
        finish("padded", o.transpose(1, 2).unflatten(1, (Amax, B))[blk_valid])

    if backward and dev.type == "cpu":
        impls = [i for i in impls if i != "flex"]  # flex_attention has no backward on CPU
    fns = {i: (padded if i == "padded" else packed(i)) for i in impls}
    ctx = torch.enable_grad() if backward else torch.no_grad()
    with ctx:
        med = time_interleaved(fns, reps, warmup, dev)
    S, Amax = blk_valid.shape
    computed = {"padded": S * Amax * B}
    return rows("drafter block", "fwd+bwd" if backward else "fwd", med, outs, A * B, computed,
                extra={"anchors": A, "ctx_tokens": n, "padded_ctx_tokens": S * max(lengths)})


def rows(op, mode, med, outs, real, computed, extra=None) -> list[dict]:
    ref = outs.get("ref")
    out = []
    for impl, sec in med.items():
        diff = float((outs[impl].float() - ref.float()).abs().max()) if ref is not None else float("nan")
        out.append({"op": op, "mode": mode, "impl": impl, "ms": sec * 1e3,
                    "speedup_vs_ref": med["ref"] / sec if "ref" in med else float("nan"),
                    "real_tokens": real, "computed_tokens": computed.get(impl, real),
                    "max_abs_diff_vs_ref": diff, **(extra or {})})
    return out


def print_table(rows_: list[dict], header: str) -> None:
    print(f"\n{header}")
    print(f"{'op':<15}{'mode':<9}{'impl':<8}{'ms/call':>11}{'x ref':>8}{'real tok':>10}{'computed':>10}"
          f"{'waste':>7}{'max|diff|':>11}")
    for r in rows_:
        print(f"{r['op']:<15}{r['mode']:<9}{r['impl']:<8}{r['ms']:>11.2f}{r['speedup_vs_ref']:>8.2f}"
              f"{r['real_tokens']:>10}{r['computed_tokens']:>10}{r['computed_tokens'] / r['real_tokens']:>7.2f}"
              f"{r['max_abs_diff_vs_ref']:>11.2e}")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--impls", nargs="*", default=None,
                   help="subset of ref sdpa padded flex flash (default: all available)")
    p.add_argument("--reps", type=ranged(int, ge=1), default=5)
    p.add_argument("--warmup", type=ranged(int, ge=0), default=1)
    p.add_argument("--device", default="auto", help="auto: cuda when available")
    p.add_argument("--seed", type=ranged(int, ge=0), default=0)
    p.add_argument("--threads", type=ranged(int, ge=0), default=0, help="CPU intra-op threads (0: torch's default)")
    p.add_argument("--json", default="runs/bench/attention.json")
    args = p.parse_args(argv)
    check_outputs(p, args)
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    s = PRESETS[args.preset]
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, s.dtype)
    lengths = sample_lengths(s, torch.Generator().manual_seed(args.seed))
    impls = available_impls(dev, dtype, args.impls)
    if "ref" not in impls:
        impls.insert(0, "ref")  # every ratio is against it
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    t0 = time.perf_counter()
    result = bench_target(s, dev, dtype, lengths, impls, args.reps, args.warmup)
    result += bench_drafter(s, dev, dtype, lengths, impls, args.reps, args.warmup, backward=False)
    result += bench_drafter(s, dev, dtype, lengths, impls, args.reps, args.warmup, backward=True)
    meta = {"preset": args.preset, "shape": asdict(s), "device": str(dev), "seqs": len(lengths),
            "longest": max(lengths), "reps": args.reps, "warmup": args.warmup, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "wall_s": time.perf_counter() - t0,
            "auto": {"target": attn.resolve("auto", "causal", torch.empty(0, device=dev, dtype=dtype)),
                     "drafter": attn.resolve("auto", "block", torch.empty(0, device=dev, dtype=dtype))}}
    print_table(result, f"attention ({args.preset}: {s.tokens} tokens in {len(lengths)} seqs, longest "
                        f"{max(lengths)}, heads {s.heads}/{s.kv_heads} x {s.head_dim}, {s.dtype}, {dev}; "
                        f"median of {args.reps}; auto picks {meta['auto']})")
    write_json(args.json, {"meta": meta, "rows": result})
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
