"""A five-minute check of a GPU machine at the Qwen3-8B shape, with random weights.

    python -m dflash_dist.bench.gpu_check                 # on a machine with one or more GPUs (not torchrun)
    python -m dflash_dist.bench.gpu_check --dry-run       # tiny shapes on CPU: exercises every section

Sections (each one is timed, interleaved where it compares, and reported even if another one fails):
  attention  the fast paths against the reference on this GPU (flash needs flash-attn installed)
  target     TinyQwen3 at the Qwen3-8B shape (36 layers, hidden 4096, 32/8 heads x 128, MLP 12288,
             vocab 151936) in bf16 over one packed batch of 49,152 tokens: tokens/s and model FLOP
             utilisation, with the "auto" attention path and with "ref". --layers N < 36 runs N layers and
             scales the time by 36/N (said so in the table).
  drafter    one DFlash training step (forward, loss, backward, AdamW) of DFlashDrafter with 1 and 5
             layers at that shape: time per step and per anchor; as drafter.py runs it (one attention
             call per sequence) and batched (one packed_block_attention call per layer, the proposed change).
  transport  packet path vs raw NCCL send/recv between GPU 0 and GPU 1, when there are two.
  run        the embedded tiny job end to end under torchrun with NCCL on every GPU (at most 8: one drafter
             per node, the rest targets), when there are two or more: exit code, tokens/s, wait fractions.
Prints one table and writes JSON. Without CUDA (and without --dry-run) it says so and exits with status 2.
Time: flex compiles once or twice per op (automatic dynamic shapes), ~1 min each on a GPU; no section
starts after --budget-s (240 s), so the whole check ends in about five minutes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from dflash_dist.bench import attention as attn_bench
from dflash_dist.config import TargetConfig, default_target_layer_ids
from dflash_dist.models import attention as attn
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec
from dflash_dist.models.qwen3 import TinyQwen3
from dflash_dist.objective import block_labels, dflash_loss

QWEN3_8B = TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_eps=1e-6)
TINY = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                    num_kv_heads=2, head_dim=16)
# Dense bf16 tensor-core peaks from NVIDIA's datasheets (no sparsity), in TFLOP/s; --peak-tflops overrides.
PEAK_TFLOPS = {"H200": 989, "H100 PCIe": 756, "H100": 989, "GH200": 989, "B200": 2250, "A100": 312, "L40S": 362,
               "A10": 125, "L4": 121}


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []
        self.data: dict[str, object] = {}

    def add(self, section: str, what: str, value, note: str = "") -> None:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        self.rows.append((section, what, text, note))
        finite = not isinstance(value, float) or math.isfinite(value)
        self.data.setdefault(section, {})[what] = value if finite else None

    def print(self) -> None:
        w = [max(len(r[i]) for r in self.rows + [("section", "check", "value", "")]) for i in range(3)]
        print(f"\n{'section':<{w[0]}}  {'check':<{w[1]}}  {'value':>{w[2]}}  note")
        for s, c, v, n in self.rows:
            print(f"{s:<{w[0]}}  {c:<{w[1]}}  {v:>{w[2]}}  {n}")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, reps: int, warmup: int, dev: torch.device) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def packed_lengths(tokens: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    s = attn_bench.Shape(tokens, lo, hi, 1, 1, 1, "float32", 1, 1)
    return attn_bench.sample_lengths(s, torch.Generator().manual_seed(seed))


# -- attention agreement ----------------------------------------------------------------------------

def check_attention(rep: Report, dev: torch.device, dry: bool) -> None:
    """Fast paths vs the reference on this device: fp32 for flex, bf16 for flash; drafter grads too."""
    lengths = [1, 200, 129, 1, 317]
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0)
    n, g = sum(lengths), torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=g).to(dev) for h in (8, 2, 2))
    ref = attn.packed_causal_attention(q, k, v, cu, impl="ref")
    rep.add("attention", "causal flex fp32 max|diff|",
            float((attn.packed_causal_attention(q, k, v, cu, impl="flex") - ref).abs().max()))
    if dev.type == "cuda" and attn.flash_available():
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        d = (attn.packed_causal_attention(qb, kb, vb, cu, impl="flash")
             - attn.packed_causal_attention(qb, kb, vb, cu, impl="ref"))
        rep.add("attention", "causal flash bf16 max|diff|", float(d.abs().max()), "bf16 rounding is ~1e-2")
    else:
        rep.add("attention", "causal flash", "n/a", "needs CUDA and flash-attn")
    B = 16
    starts, ends = [], []
    for s, L in zip(cu[:-1].tolist(), lengths):
        for p in sorted({0, max(0, L - B)} | set(range(0, max(1, L - B), 37))):
            starts.append(s), ends.append(s + p)
    A = len(starts)
    st, en = torch.tensor(starts, device=dev), torch.tensor(ends, device=dev)
    leaves = [torch.randn(A, B, 8, 64, generator=g).to(dev), k, v,
              torch.randn(A, B, 2, 64, generator=g).to(dev), torch.randn(A, B, 2, 64, generator=g).to(dev)]
    outs, grads = {}, {}
    for impl in ("ref", "flex"):
        backward = dev.type == "cuda" or impl == "ref"  # flex has no backward on CPU
        xs = [t.detach().clone().requires_grad_(backward) for t in leaves]
        with torch.set_grad_enabled(backward):
            out = attn.packed_block_attention(*xs, st, en, impl=impl)
            if backward:
                out.square().sum().backward()
                grads[impl] = torch.cat([x.grad.flatten() for x in xs])
        outs[impl] = out.detach()
    rep.add("attention", "drafter flex fp32 max|diff|", float((outs["flex"] - outs["ref"]).abs().max()))
    if "flex" in grads:
        rep.add("attention", "drafter flex grad max|diff|", float((grads["flex"] - grads["ref"]).abs().max()))


# -- target forward ---------------------------------------------------------------------------------

def target_flops(tc: TargetConfig, lengths: list[int], layers: int) -> float:
    """Forward FLOPs of `layers` decoder layers: 2 per weight per token, plus causal attention scores
    and values (2 matmuls, 2 FLOPs per multiply-add, over l(l+1)/2 pairs per sequence and head)."""
    h, hk, d, H, I = tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.hidden_size, tc.intermediate_size
    weights = H * (h + 2 * hk) * d + h * d * H + 3 * H * I
    pairs = sum(l * (l + 1) // 2 for l in lengths)
    return layers * (2 * weights * sum(lengths) + 4 * h * d * pairs)


def peak_tflops(dev: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def build_target(tc: TargetConfig, dev: torch.device, dtype: torch.dtype) -> TinyQwen3:
    """Parameters are created directly on the device in the compute dtype: no 32 GB fp32 copy on the host."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = TinyQwen3(tc)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def check_target(rep: Report, model: TinyQwen3, tc: TargetConfig, full_layers: int, lengths: list[int],
                 dev: torch.device, args) -> None:
    n = sum(lengths)
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0)
    ids = torch.randint(0, tc.vocab_size, (n,), device=dev)
    from dflash_dist.data.collate import position_ids
    pos = position_ids(cu)
    scale = full_layers / tc.num_layers
    peak = peak_tflops(dev, args.peak_tflops)
    flops = target_flops(tc, lengths, full_layers)
    note = f"{tc.num_layers} layers run, time x{scale:g}" if scale != 1 else f"{full_layers} layers"
    rep.add("target", "batch", f"{n} tok / {len(lengths)} seqs", f"longest {max(lengths)}")
    for impl in args.target_attn:
        attn.set_default_impl(impl)
        try:
            with torch.no_grad():
                t = timed(lambda: model.capture(ids, cu, pos, [tc.num_layers - 1]), args.reps, 1, dev) * scale
        finally:
            attn.set_default_impl("auto")
        path = attn.resolve(impl, "causal", ids.new_empty(0, dtype=next(model.parameters()).dtype))
        rep.add("target", f"forward s ({impl}->{path})", t, note)
        rep.add("target", f"tokens/s ({impl}->{path})", n / t)
        if peak:
            rep.add("target", f"MFU ({impl}->{path})", flops / t / (peak * 1e12), f"peak {peak} TFLOP/s bf16 dense")
    if not peak:
        rep.add("target", "MFU", "n/a", "unknown GPU peak: pass --peak-tflops")


# -- drafter step -----------------------------------------------------------------------------------

def check_drafter(rep: Report, target: TinyQwen3, tc: TargetConfig, lengths: list[int], dev: torch.device,
                  args) -> None:
    B = 16
    ids_layers = tuple(default_target_layer_ids(tc.num_layers, 5 if tc.num_layers >= 8 else 2))
    n = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    g = torch.Generator().manual_seed(3)
    per_seq = -(-args.anchors // len(lengths))
    anchors, counts = [], []
    for s, L in zip(cu[:-1].tolist(), lengths):
        pick = sorted(torch.randperm(max(0, L - B + 1), generator=g)[:per_seq].tolist())
        anchors += [s + p for p in pick]
        counts.append(len(pick))
    anchors_t = torch.tensor(anchors, device=dev)
    anchor_cu = torch.tensor([0] + counts, device=dev).cumsum(0)
    cu, ids = cu.to(dev), torch.randint(0, tc.vocab_size - 1, (n,), device=dev)
    from dflash_dist.data.collate import position_ids
    pos, mask = position_ids(cu), torch.ones(n, dtype=torch.bool, device=dev)
    feats = torch.randn(n, len(ids_layers) * tc.hidden_size, device=dev, dtype=next(target.parameters()).dtype)
    labels, weights = block_labels(ids, mask, cu, anchors_t, anchor_cu, B, 7.0)
    # As the drafter role trains: bf16 autocast on CUDA, plain float32 on CPU.
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    A = len(anchors)
    rep.add("drafter", "anchors / block", f"{A} / {B}", f"{per_seq} per sequence at most")
    t_start = time.perf_counter()
    for layers in args.draft_layers:
        if time.perf_counter() - t_start > args.budget_s / 3:
            rep.add("drafter", f"{layers}-layer", "skipped", "drafter section past a third of the budget")
            continue
        spec = DraftSpec(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                         num_layers=layers, num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                         rope_theta=tc.rope_theta, rms_eps=tc.rms_eps, block_size=B, mask_token_id=tc.vocab_size - 1,
                         target_layer_ids=ids_layers, num_target_layers=tc.num_layers)
        with torch.device(dev):
            model = DFlashDrafter(spec)
        model.attach_target_head(target.embed_tokens, target.lm_head)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            with autocast:
                logits = model(feats, ids, cu, pos, anchors_t, anchor_cu)
            loss, _ = dflash_loss(logits, labels, weights)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = timed(step, args.reps, 1, dev)
        rep.add("drafter", f"{layers}-layer step ms", t * 1e3)
        rep.add("drafter", f"{layers}-layer us/anchor", t * 1e6 / A)
        del model, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# -- transport --------------------------------------------------------------------------------------

def check_transport(rep: Report, dev: torch.device, args) -> None:
    from dflash_dist.bench import transport

    if dev.type == "cuda" and torch.cuda.device_count() < 2:
        rep.add("transport", "NCCL send/recv", "n/a", "needs two GPUs")
        return
    out = Path(tempfile.mkdtemp()) / "transport.json"
    sizes = ["1"] if args.dry_run else ["16", "128", "1024"]
    real = "8" if args.dry_run else str(args.tokens)
    feat = "64" if args.dry_run else str(5 * 4096)
    transport.main(["--sizes", *sizes, "--real-tokens", real, "--feat-dim", feat, "--reps", "5",
                    "--backend", "gloo" if dev.type == "cpu" else "nccl", "--json", str(out)])
    for r in json.loads(out.read_text())["rows"]:
        rep.add("transport", f"{r['case']} GiB/s packet | raw", f"{r['packet_gib_s']:.2f} | {r['raw_gib_s']:.2f}",
                f"packet/raw {r['packet/raw']:.2f}")


# -- a short disaggregated run -----------------------------------------------------------------------

def check_run(rep: Report, dev: torch.device, args) -> None:
    nproc = min(torch.cuda.device_count(), 8) if dev.type == "cuda" else 2
    if nproc < 2:
        rep.add("run", "NCCL run", "n/a", "needs two GPUs")
        return
    run_dir = Path(tempfile.mkdtemp())
    # The embedded tiny job, one epoch, no evaluation: the point is the NCCL path, start to finish.
    size = ["data.synthetic.num_samples=80", "data.synthetic.max_len=120"] if args.dry_run else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dflash_dist.train", f"dist.backend={'nccl' if dev.type == 'cuda' else 'gloo'}", "train.epochs=1",
           "train.eval_prompts=0", "wandb.mode=disabled", f"train.run_dir={run_dir}", f"data.cache_dir={run_dir}",
           *size]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout_s,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    rep.add("run", f"torchrun {nproc} ranks exit code", res.returncode, f"{wall:.0f} s wall, incl. start-up")
    if res.returncode != 0:
        rep.data["run"]["log_tail"] = (res.stdout + res.stderr)[-4000:]
        return
    sm = json.loads((run_dir / "summary.json").read_text())
    rep.add("run", "targets / drafters", f"{sm['num_targets']} / {sm['num_drafters']}")
    rep.add("run", "tokens/s (training)", float(sm["tok_per_s"]), f"{sm['tokens']} tokens, {sm['steps']} steps")
    rep.add("run", "wait targets / drafters", f"{sm['wait_targets']:.0%} / {sm['wait_drafters']:.0%}",
            f"bottleneck: {sm['balance']['bottleneck']}" if sm.get("balance") else "")


# -- main -------------------------------------------------------------------------------------------

def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (or on the GPU if there is one)")
    p.add_argument("--layers", type=int, default=36, help="target layers to run (time is scaled to 36)")
    p.add_argument("--tokens", type=int, default=49152)
    p.add_argument("--draft-layers", type=int, nargs="*", default=[1, 5])
    p.add_argument("--anchors", type=int, default=1024, help="anchors per batch for the drafter step")
    p.add_argument("--target-attn", nargs="*", default=["auto", "ref"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--skip", nargs="*", default=[], choices=["attention", "target", "drafter", "transport", "run"])
    p.add_argument("--run-timeout-s", type=float, default=150, help="limit of the end-to-end torchrun run")
    p.add_argument("--budget-s", type=float, default=240, help="start no new section after this many seconds")
    p.add_argument("--json", default="runs/bench/gpu_check.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print("gpu_check: no CUDA device here. It measures GPUs; run it on a GPU machine, or pass --dry-run "
              "to exercise every section at tiny shapes on CPU.", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    if args.dry_run:
        tc, dtype, full = TINY, torch.float32, TINY.num_layers
        lengths = packed_lengths(256, 1, 96)
        args.anchors, args.draft_layers, args.reps = 16, [1], 1
        attn.flex_compile = dev.type == "cuda"  # compiling flex on CPU takes minutes
    else:
        full = QWEN3_8B.num_layers
        tc, dtype = replace(QWEN3_8B, num_layers=min(args.layers, full)), torch.bfloat16
        lengths = packed_lengths(args.tokens, 64, 4096)
    rep = Report()
    rep.add("machine", "device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
            f"{torch.cuda.device_count()} GPU(s)" if dev.type == "cuda" else "")
    rep.add("machine", "torch / flash-attn", f"{torch.__version__} / {attn.flash_available()}")
    t0 = time.perf_counter()
    target = None
    # Transport and the run before the model is built: their processes then have the GPUs to themselves.
    for section in ("attention", "transport", "run", "target", "drafter"):
        if section in args.skip:
            continue
        if time.perf_counter() - t0 > args.budget_s:
            rep.add(section, "skipped", f"past the {args.budget_s:g} s budget")
            continue
        ts = time.perf_counter()
        try:
            if section == "attention":
                check_attention(rep, dev, args.dry_run)
            elif section in ("target", "drafter"):
                if target is None:
                    target = build_target(tc, dev, dtype)
                if section == "target":
                    check_target(rep, target, tc, full, lengths, dev, args)
                else:
                    check_drafter(rep, target, tc, lengths, dev, args)
            elif section == "run":
                check_run(rep, dev, args)
            else:
                check_transport(rep, dev, args)
        except Exception as exc:  # one failing section must not hide the others' figures
            rep.add(section, "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")
            rep.data[section]["traceback"] = traceback.format_exc()
        rep.add(section, "section s", time.perf_counter() - ts)
    rep.add("machine", "total s", time.perf_counter() - t0)
    rep.print()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep.data, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
