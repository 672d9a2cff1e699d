"""A short check of a GPU machine at the reference shape (Qwen3-8B target, 5-layer drafter), random weights.

    python -m dflash_dist.bench.gpu_check [--json PATH] [--sections env,grads,drafter,target,nccl,overlap,cost,variants]
    python -m dflash_dist.bench.gpu_check --dry-run      # tiny shapes on CPU, gloo: every section runs

Each section runs in its own process (this module again, with --section NAME) in a session of its own,
under a hard timeout that ends the section's whole process tree (torchrun's workers included); a section
that fails or times out is reported with the tail of its output and the next one starts. Most decisive
first:
  env      torch, CUDA and NCCL versions; GPUs (name, count, memory); whether flash-attn, liger-kernel and
           triton import; a C compiler (inductor needs one for flex attention); PYTORCH_CUDA_ALLOC_CONF.
  grads    correctness of the GPU attention paths (bench.gpu_grads): on a small packed batch, the drafter
           step's loss and every gradient on the flex and sdpa paths against the ref path (float32 and
           bf16 autocast), and a transformers target's captured features on flex (and flash) against ref;
           a mismatch fails the section.
  drafter  one training step (dflash_dist.training.step.drafter_step + AdamW) of the 5-layer drafter at Qwen3-8B
           width, on the batch with the mean and the one with the most anchors of the 902K-sample plan
           (configs/qwen3_8b.yaml: 49,152 tokens, 64 sequences, 512 anchors per sequence, its anchor
           chunk). Attention warm-up (path, compile seconds; the SDPA fallback exercised too), step time
           beside the cost model's prediction, peak memory against the memory model, graphs compiled
           after the warm-up.
  target   transformers Qwen3 at the full Qwen3-8B shape, random bf16 weights built on the GPU, through
           HFTarget.capture (layers 1, 9, 17, 25, 33; it stops after 33) over one 49,152-token batch with a
           16K-token sequence: capture time (beside the cost model's), tokens/s, MFU, peak memory against
           the memory model, and
           isolation (one sequence's tokens changed: every other sequence's features bitwise equal).
  nccl     1 GPU: the embedded job with roles.mode=colocated under torchrun on NCCL; 2+ GPUs: packet vs raw
           NCCL send of one reference-size packet (49,152 tokens x 5 x 4096 bf16, 1.9 GiB); 3+ GPUs: the
           embedded job with 2 drafters per node and 2 epochs. Exit code, the summary's replica agreement and
           each epoch's idle drafters in its last step, and no watchdog or timeout line.
  overlap  2+ GPUs (bench.gpu_overlap): the drafter step's gradient all-reduce under DDP against the same
           step with one flat all-reduce after its backward, and each alone: the share of the all-reduce
           DDP hides behind the last anchor chunk's backward (1 GPU: n/a).
  cost     the cost model's drafter:target time ratio against the real target capture and drafter step
           (bench.cost.validate_shape at two bf16 shapes, one target-heavy, one drafter-heavy, sdpa paths,
           the device's rates probed in between); outside 0.7-1.4 fails the section. With the drafter and
           target sections' measured/predicted rows, the calibration of `--eff-*` for bench.cost.
  variants every variant of the registry (DFlash, DFlash 2, DSpark, ...) with its defaults at the drafter's
           reference shape, one step each on the mean batch: seconds and the ratio to DFlash's in the same
           process, beside the cost model; peak memory beside the memory model (the heads counted).
One table (section, metric, value, note) on stdout and a JSON file. Time: each section has a cap (CAPS)
and none runs past the budget (470 s on one GPU, 590 s on several), so the check ends within 8 and 10
minutes; a section the budget does not reach is reported as skipped (run it with --sections). Without CUDA (and without --dry-run) it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from dflash_dist.bench.gpu_setup import device, feature_layers, packed_batch, reference_drafter
from dflash_dist.bench.jobs import check_outputs
from dflash_dist.bench.sections import ROOT, Report, print_table, run_one, run_sections, run_tree
from dflash_dist.config import Config, TargetConfig, load_config, ranged

if TYPE_CHECKING:  # torch is imported where a section runs: --help and the dry run's parent stay light
    import torch

# torch is imported where it is used: a section's process (and the hidden test section) starts in a
# fraction of a second, and the parent process never loads what the sections measure.
SECTIONS = ("env", "grads", "drafter", "target", "nccl", "overlap", "cost", "variants")
HIDDEN = ("hang",)  # test hook: a section that never ends (tests/integration/test_bench_runs.py)
CAPS = {"env": 30, "grads": 120, "drafter": 240, "target": 150, "nccl": 80, "overlap": 150, "cost": 60,
        "variants": 150, "hang": 600}  # seconds; nccl: 220 on 2+ GPUs
BUDGET_S = {1: 470, 2: 590}  # one GPU / several (and --dry-run)
QWEN3_8B = TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_eps=1e-6)
PLAN_SAMPLES = {False: 902_000, True: 3_000}  # the reference chat mix (bench.plan) / the dry run's
LONG_SEQ = {False: 16_384, True: 96}  # the target batch's long sequence
# Dense bf16 tensor-core peaks from NVIDIA's datasheets (no sparsity), in TFLOP/s.
PEAK_TFLOPS = {"H200": 989, "H100 PCIe": 756, "H100": 989, "GH200": 989, "B200": 2250, "A100": 312, "L40S": 362,
               "A10": 125, "L4": 121}
# A collective that timed out, or the heartbeat watchdog naming a silent or failed peer (dflash_dist.runtime.liveness).
WATCHDOG = re.compile(r"(?i)watchdog caught|collective operation timeout|timed out|went silent|exiting instead of waiting")


# -- shared set-up ------------------------------------------------------------------------------------

def reference_config(dry: bool) -> Config:
    """configs/qwen3_8b.yaml with the target described by its shape (kind=tiny: no model directory
    needed); the dry run: the default (tiny) config, with a small anchor chunk so chunking runs."""
    if dry:
        return load_config(None, ["objective.anchor_chunk=24", "model.draft.num_layers=2"])
    shape = [f"model.target.{k}={getattr(QWEN3_8B, k)}" for k in
             ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "rope_theta", "rms_eps")]
    return load_config(str(ROOT / "configs" / "qwen3_8b.yaml"), ["model.target.kind=tiny", *shape])


def plan_batches(cfg: Config, dry: bool) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict]:
    """The batch whose anchors are nearest the plan's mean and the one with the most, as (lengths,
    supervised) per sample, from epoch 0 of the benchmark's chat mix at the config's budgets. Anchors
    per sample: min(supervised, objective.num_anchors) (one more than draw_anchors finds only where a
    sample's first token is supervised)."""
    from dflash_dist.data.synthetic import chat_lengths
    from dflash_dist.plan.epochs import build_plan

    lengths, supervised = chat_lengths(PLAN_SAMPLES[dry], cfg.plan.token_budget, cfg.train.seed)
    plan = build_plan(lengths, supervised, seed=cfg.train.seed, epoch=0, token_budget=cfg.plan.token_budget,
                      max_seqs=cfg.plan.max_seqs)
    per = np.add.reduceat(np.minimum(supervised, cfg.objective.num_anchors)[plan.indices], plan.offsets[:-1])
    mean, worst = int(np.argmin(np.abs(per - per.mean()))), int(np.argmax(per))
    pick = {name: (lengths[plan.batch(b)], supervised[plan.batch(b)]) for name, b in (("mean", mean), ("worst", worst))}
    return pick, {"batches": len(plan), "mean_anchors": float(per.mean()), "max_anchors": int(per.max())}


def predicted_peak(cfg: Config, role: str, dev: torch.device, lengths, anchors_per_seq=(), anchor_pos=(),
                   attention: str = "flex") -> tuple[dict | None, str]:
    """The memory model's prediction for `role` at this one batch, as this check runs it (one process:
    no DDP buckets; one feature tensor alive, as one packet in flight), or (None, why not). Returns
    ({"peak": GiB, "tensors": GiB without allocator slack and the CUDA context}, source)."""
    import torch

    try:
        from dflash_dist.forecast import memory
        from dflash_dist.forecast.shapes import model_shapes
        lengths = [int(x) for x in lengths]
        seq_anchors = tuple(int(x) for x in anchors_per_seq)
        batch = memory.BatchShape(tokens=sum(lengths), seqs=len(lengths), anchors=sum(seq_anchors),
                                  seq_lens=tuple(lengths), seq_anchors=seq_anchors,
                                  anchor_pos=tuple(int(x) for x in anchor_pos))
        cfg_one = replace(cfg, transport=replace(cfg.transport, max_in_flight=1))
        device_gib = torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda" else 141.0
        pred = memory.predict(cfg_one, model_shapes(cfg_one), batch, device_gib,
                              sharding=memory.Sharding(drafters=1, ddp=False, drafters_per_target=1),
                              precision=memory.Precision.from_config(cfg_one, dev.type, attention=attention))
        terms = pred.roles[role].terms
    except Exception as exc:  # absent, or still being written: say why, keep the measurement
        return None, f"n/a: memory model unavailable ({type(exc).__name__}: {str(exc)[:80]})"
    total = sum(terms.values()) / 2**30
    outside = (terms.get("slack", 0.0) + terms.get("cuda_reserved", 0.0)) / 2**30
    return {"peak": total, "tensors": total - outside}, "dflash_dist.forecast.memory.predict"


def peak_gib(dev: torch.device) -> tuple[float, float] | None:
    """(max allocated, max reserved) GiB since the last reset: tensors, and the allocator's segments."""
    import torch

    if dev.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(dev) / 2**30, torch.cuda.max_memory_reserved(dev) / 2**30


def reset_peak(dev: torch.device) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def report_memory(rep: Report, what: str, measured: tuple[float, float] | None,
                  predicted: tuple[dict | None, str]) -> None:
    """Measured peaks against the model: its tensor terms against max allocated (the 0.85-1.15 target),
    its total (with allocator slack, without the CUDA context) against max reserved."""
    pred, why = predicted
    if measured is None:
        rep.add(f"{what} peak GiB", "n/a", "CPU: no allocator statistics")
    else:
        rep.add(f"{what} peak GiB", measured[0], f"max allocated; reserved {measured[1]:.1f}")
    rep.add(f"{what} predicted GiB", pred["peak"] if pred else "n/a",
            f"{why}; tensors {pred['tensors']:.1f}" if pred else why)
    if pred and measured:
        rep.add(f"{what} predicted/measured", pred["tensors"] / measured[0], "tensor terms / max allocated; target 0.85-1.15")
        rep.add(f"{what} predicted/reserved", (pred["peak"] - 1.0) / measured[1], "total less 1 GiB CUDA context / max reserved")


def report_time(rep: Report, what: str, measured: float, cfg: Config, role: str, dev: torch.device, lengths,
                seq_anchors=(), anchor_pos=(), attention: str = "flex") -> None:
    """The cost model's seconds beside a measured one: measured / predicted is the factor by which its
    default efficiencies are off on this machine (bench.cost --eff-* takes the calibrated ones)."""
    try:
        from dflash_dist.bench.cost import predicted_seconds
        pred = predicted_seconds(cfg, role, dev, lengths, seq_anchors, anchor_pos, attention)
    except Exception as exc:  # the measurement stands without the model: say why
        rep.add(f"{what} predicted s", "n/a", f"cost model unavailable ({type(exc).__name__}: {str(exc)[:80]})")
        return
    rep.add(f"{what} predicted s", pred, "dflash_dist.forecast.cost: the device's peaks, default efficiencies")
    rep.add(f"{what} measured/predicted", measured / pred, "1: the default efficiencies hold here")


# -- env ------------------------------------------------------------------------------------------------

def section_env(rep: Report, dry: bool, deadline: float) -> None:
    import torch

    from dflash_dist.models import attention as attn

    rep.add("torch", torch.__version__, sys.version.split()[0])
    rep.add("CUDA", torch.version.cuda or "none (CPU build)")
    cuda = torch.cuda.is_available()
    nccl = torch.cuda.nccl.version() if cuda else "n/a"  # a tuple in recent torch, an int in older ones
    rep.add("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    n = torch.cuda.device_count() if cuda else 0
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    kinds = sorted({(p.name, round(p.total_memory / 2**30), f"sm_{p.major}{p.minor}") for p in props})
    rep.add("GPUs", n, "; ".join(f"{name}, {gib} GiB, {sm}" for name, gib, sm in kinds) or "none")
    for mod in ("flash_attn", "liger_kernel", "triton"):
        try:
            m = importlib.import_module(mod)
            rep.add(mod, "yes", str(getattr(m, "__version__", "")))
        except Exception as exc:  # an import can fail in many ways (ABI, CUDA mismatch): all mean "no"
            rep.add(mod, "no", f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")
    cc = shutil.which("cc") or shutil.which("gcc")
    version = ""
    if cc:
        res = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10)
        version = (res.stdout.splitlines() or [""])[0]
    rep.add("C compiler", cc or "none", version or "inductor (flex attention) needs one")
    rep.add("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "(unset)"),
            "launch/run.sh sets expandable_segments:True unless set")
    like = torch.empty(0, device=device(dry), dtype=torch.bfloat16)
    rep.add("attention auto path", f"causal {attn.resolve(None, 'causal', like)}, block {attn.resolve(None, 'block', like)}",
            "before any warm-up")


# -- drafter ----------------------------------------------------------------------------------------

def warm_block_attention(rep: Report, dev, compute, t, block_size: int) -> None:
    """The drafter op's warm-up as the drafter role runs it (bf16 autocast on CUDA, float32 on CPU), and
    whether its SDPA fallback runs forward and backward here."""
    import torch

    from dflash_dist.models import attention as attn
    autocast_dtype = torch.bfloat16 if dev.type == "cuda" else None
    heads = dict(heads=t.num_heads, kv_heads=t.num_kv_heads, head_dim=t.head_dim, block_size=block_size)
    warm = attn.warm_up(dev, compute, ops=("block",), autocast_dtype=autocast_dtype, **heads)["block"]
    rep.add("attention path", warm["path"], warm.get("flex_error", "auto"))
    rep.add("attention warm-up s", warm["seconds"], f"graphs per layout {warm['graphs']} (the last must be 0)")
    try:
        fallback = attn.warm_up(dev, compute, ops=("block",), impl="sdpa", autocast_dtype=autocast_dtype, **heads)
        rep.add("sdpa fallback fwd+bwd", "ok", f"{fallback['block']['seconds']:.1f} s")
    except RuntimeError as exc:
        rep.add("sdpa fallback fwd+bwd", "FAILED", str(exc)[:160])


def measure_step(rep: Report, name: str, cfg: Config, dev, compute, model, spec, opt, settings, lengths, supervised,
                 first_step: bool = False) -> float | None:
    """One drafter step (drafter_step + AdamW) on a random batch of these sequence lengths, its seconds
    beside the cost model's and its peak memory beside the memory model's; None where it ran out of memory.
    `first_step`: the first step also allocates AdamW's state, so a second one is timed."""
    import torch

    from dflash_dist.bench.common import timed
    from dflash_dist.models import attention as attn
    from dflash_dist.parallel.transport import packet_spec
    from dflash_dist.training.objective import draw_anchors
    from dflash_dist.training.step import StepBatch, drafter_step

    o = cfg.objective
    batch = packed_batch(lengths, supervised, spec.vocab_size, dev)
    anchors, anchor_cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, o.num_anchors,
                                      torch.Generator().manual_seed(1))
    anchors, anchor_cu = anchors.to(dev), anchor_cu.to(dev)
    # The packet's feature width: the captured layers', and the final hidden state where it is sent.
    feats = torch.randn(batch.num_tokens, packet_spec(cfg, spec, dev).feat_dim, device=dev, dtype=compute)
    A = anchors.numel()
    rep.add(f"{name} batch", f"{batch.num_tokens} tok, {batch.num_seqs} seqs, {A} anchors",
            f"longest {int(np.max(lengths))}")

    def step():
        drafter_step(model, StepBatch(batch, feats, None, anchors, anchor_cu), settings)
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak(dev)
    try:
        seconds = timed(step, 1, 0, dev)
        if first_step:
            rep.add(f"{name} first step s", seconds, "incl. optimizer state allocation")
            seconds = timed(step, 1, 0, dev)
    except torch.OutOfMemoryError as exc:
        rep.add(f"{name} step", "OOM", str(exc).splitlines()[0][:160])
        return None
    rep.add(f"{name} step s", seconds, f"{A / seconds:.0f} anchors/s")
    seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=dev), anchor_cu.diff())
    shape = (lengths, anchor_cu.diff().tolist(), (anchors - batch.cu_seqlens[seq]).tolist())
    path = attn.resolve(None, "block", feats)
    report_time(rep, f"{name} step", seconds, cfg, "drafter", dev, *shape, attention=path)
    report_memory(rep, name, peak_gib(dev), predicted_peak(cfg, "drafter", dev, *shape, attention=path))
    return seconds


def section_drafter(rep: Report, dry: bool, deadline: float) -> None:
    import torch

    from dflash_dist.models import attention as attn
    from dflash_dist.training.step import drafter_autocast, step_settings

    dev, cfg = device(dry), reference_config(dry)
    t, o = cfg.model.target, cfg.objective
    B = o.block_size
    batches, stats = plan_batches(cfg, dry)
    rep.add("plan anchors per batch", f"mean {stats['mean_anchors']:.0f}, max {stats['max_anchors']}",
            f"{stats['batches']} batches of {PLAN_SAMPLES[dry]} samples, budget {cfg.plan.token_budget}")
    compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    spec, model = reference_drafter(cfg, dev, compute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rep.add("drafter", f"{spec.num_layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params",
            f"anchor chunk {o.anchor_chunk or 'all'}, loss rows {o.loss_rows}, checkpoint_layers "
            f"{cfg.model.draft.checkpoint_layers}")

    warm_block_attention(rep, dev, compute, t, B)
    settings = replace(step_settings(cfg, spec, drafter_autocast(dev)), batch_mean=True)

    for name, (lengths, supervised) in batches.items():
        measure_step(rep, name, cfg, dev, compute, model, spec, opt, settings, lengths, supervised,
                     first_step=name == "mean")
    rep.add("graphs compiled after warm-up", attn.backend.compile_stats()["late_graphs"], "target 0")


def section_variants(rep: Report, dry: bool, deadline: float) -> None:
    """Every other DFlash-family variant (models/variants' registry) at the reference shape with its
    defaults, one step each on the plan's mean batch (a warm-up step first: AdamW's state, the variant's
    heads), beside a DFlash step timed the same way in the same process: step seconds, the ratio, the cost
    and memory models' predictions (the warm-up step compiles the attention)."""
    import torch

    from dflash_dist.models.variants import VARIANTS, with_variant
    from dflash_dist.training.step import drafter_autocast, step_settings

    dev, base = device(dry), reference_config(dry)
    compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lengths, supervised = plan_batches(base, dry)[0]["mean"]
    seconds = {}
    for name in VARIANTS:
        if time.perf_counter() > deadline - 5:
            rep.add(f"{name} step", "skipped", "the section's time ran out")
            continue
        cfg = with_variant(base, name)
        spec, model = reference_drafter(cfg, dev, compute)
        params = sum(p.numel() for p in model.parameters())
        rep.add(f"{name} drafter", f"{params / 1e6:.1f} M params", f"{spec.family.title}, its defaults")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        settings = replace(step_settings(cfg, spec, drafter_autocast(dev)), batch_mean=True)
        seconds[name] = measure_step(rep, name, cfg, dev, compute, model, spec, opt, settings, lengths, supervised,
                                     first_step=True)
        del model, opt
        if name != "dflash" and seconds.get("dflash") and seconds[name]:
            rep.add(f"{name} / dflash step", seconds[name] / seconds["dflash"], "same batch, same process")


# -- target -----------------------------------------------------------------------------------------

def target_flops(cfg: Config, lengths: list[int], layers: int) -> float:
    """The forecast's count (`forecast.cost.target_forward_flops`) of `layers` target layers' forward."""
    from dflash_dist.forecast.cost import target_forward_flops
    from dflash_dist.forecast.shapes import model_shapes
    return sum(target_forward_flops(model_shapes(cfg), lengths, layers))


def peak_tflops(dev: torch.device) -> float | None:
    import torch

    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def target_lengths(tokens: int, long: int, seed: int = 0) -> list[int]:
    """One `long` sequence, then chat-mix lengths (bench.plan) of at most half of it, up to `tokens`
    (the last one cut to fit): the long one stays the longest."""
    from dflash_dist.data.synthetic import chat_lengths

    rest, _ = chat_lengths(1024, tokens, seed)
    out = [long]
    for length in np.minimum(rest, long // 2).tolist():
        out.append(min(length, tokens - sum(out)))
        if sum(out) == tokens:
            break
    return [x for x in out if x > 0]


def section_target(rep: Report, dry: bool, deadline: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_dist.bench.common import sync, timed
    from dflash_dist.data.collate import position_ids
    from dflash_dist.models import attention as attn
    from dflash_dist.models.hf_target import HFTarget, _dtype_kwarg

    dev, cfg = device(dry), reference_config(dry)
    t = cfg.model.target
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hf_cfg = Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                         num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads,
                         num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
                         rms_norm_eps=t.rms_eps, max_position_embeddings=40960, tie_word_embeddings=False)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):  # straight onto the GPU in bf16: no 32 GB float32 copy on the host
        target = HFTarget(AutoModelForCausalLM.from_config(hf_cfg, **{_dtype_kwarg(): dtype}))
    sync(dev)
    rep.add("build s", time.perf_counter() - t0, f"{t.num_layers} layers, random {str(dtype).split('.')[-1]}, on {dev}")
    warm = attn.warm_up(dev, dtype, ops=("causal",), heads=t.num_heads, kv_heads=t.num_kv_heads, head_dim=t.head_dim)
    rep.add("attention path", warm["causal"]["path"], warm["causal"].get("flex_error", "auto"))
    rep.add("attention warm-up s", warm["causal"]["seconds"], f"graphs per layout {warm['causal']['graphs']}")

    lengths = target_lengths(cfg.plan.token_budget, LONG_SEQ[dry])
    n, layer_ids = sum(lengths), feature_layers(cfg)
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0)
    ids = torch.randint(0, t.vocab_size, (n,), device=dev, generator=None)
    pos = position_ids(cu)
    rep.add("batch", f"{n} tok, {len(lengths)} seqs", f"longest {max(lengths)}; layers {layer_ids}")

    def capture(tokens):
        return target.capture(tokens, cu, pos, layer_ids)[0]

    t0 = time.perf_counter()
    base = capture(ids)
    sync(dev)
    rep.add("first capture s", time.perf_counter() - t0, "incl. any compile and autotuning")
    reset_peak(dev)
    sec = timed(lambda: capture(ids), 2, 0, dev)
    layers = max(layer_ids) + 1  # capture stops after the last captured layer
    flops = target_flops(cfg, lengths, layers)
    peak = peak_tflops(dev)
    rep.add("capture s", sec, f"{layers} layers; median of 2")
    report_time(rep, "capture", sec, cfg, "target", dev, lengths)
    rep.add("tokens/s", n / sec)
    rep.add("MFU", flops / sec / (peak * 1e12) if peak else "n/a",
            f"{flops / 1e12:.0f} TFLOP incl. attention; peak {peak} TFLOP/s bf16 dense" if peak else "unknown peak")
    report_memory(rep, "capture", peak_gib(dev), predicted_peak(cfg, "target", dev, lengths))
    attn.backend.use("ref")  # the reference loop (one SDPA call per sequence) for comparison
    try:
        ref = timed(lambda: capture(ids), 1, 0, dev)
        rep.add("tokens/s (ref path)", n / ref, "one SDPA call per sequence and layer")
    finally:
        attn.backend.use(None)

    check_isolation(rep, capture, base, ids, cu, t.vocab_size)


def check_isolation(rep: Report, capture, base, ids, cu, vocab_size: int) -> None:
    """New tokens in sequence 1 leave every other sequence's features bitwise as they were."""
    import torch
    s, e = int(cu[1]), int(cu[2])
    changed = ids.clone()
    changed[s:e] = torch.randint(0, vocab_size, (e - s,), device=ids.device)
    other = capture(changed)
    keep = torch.ones(ids.numel(), dtype=torch.bool, device=ids.device)
    keep[s:e] = False
    equal = bool(torch.equal(base[keep], other[keep]))
    moved = not torch.equal(base[s:e], other[s:e])
    rep.add("isolation", "ok" if equal and moved else "FAILED",
            f"other sequences bitwise equal: {equal}; changed sequence's features changed: {moved}")


# -- nccl -------------------------------------------------------------------------------------------

def packet_vs_raw(rep: Report, dry: bool) -> None:
    from dflash_dist.bench import transport

    out = Path(tempfile.mkdtemp(prefix="gpu-check-transport-")) / "transport.json"
    tokens, feat = (64, 64) if dry else (49_152, 5 * 4096)
    transport.main(["--sizes", "--real-tokens", str(tokens), "--feat-dim", str(feat), "--reps", "2" if dry else "5",
                    "--warmup", "1", "--no-fresh", "--backend", "gloo" if dry else "nccl", "--json", str(out)])
    r = json.loads(out.read_text())["rows"][-1]
    rep.add("packet GiB/s | raw GiB/s", f"{r['packet_gib_s']:.3g} | {r['raw_gib_s']:.3g}",
            f"{r['bytes'] / 2**30:.2f} GiB packet, GPU 0 -> 1" if not dry else "gloo")
    rep.add("packet/raw", float(r["packet/raw"]), "median of per-repetition ratios")


def embedded_job(rep: Report, label: str, nproc: int, overrides: list[str], timeout: float,
                 env: dict | None = None) -> None:
    """The embedded tiny job under torchrun: exit code, the replicas and tail lines, no watchdog line."""
    run_dir = tempfile.mkdtemp(prefix="gpu-check-run-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dflash_dist.train", "wandb.mode=disabled", "train.eval_prompts=0", "train.export=false",
           "train.resume=none", f"train.run_dir={run_dir}", f"data.cache_dir={run_dir}", *overrides]
    rc, out, secs = run_tree(cmd, timeout, dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    rep.add(f"{label} exit code", "timed out" if rc is None else rc, f"{nproc} ranks, {secs:.0f} s wall; {' '.join(overrides)}")
    # The run's facts come from its summary.json (what a log line says is for people and may be reworded).
    summary = Path(run_dir) / "summary.json"
    sm = json.loads(summary.read_text()) if summary.exists() else {}
    rep.add(f"{label} replicas identical",
            f"{sm['drafter_replicas_identical']} of {sm['num_drafters']}" if sm else "missing (no summary.json)")
    idle = [e["tail_idle_drafters"] for e in sm.get("epochs", [])]
    rep.add(f"{label} epochs", len(idle), f"idle drafters in each epoch's last step: {idle}")
    bad = [line for line in out.splitlines() if WATCHDOG.search(line)]
    rep.add(f"{label} watchdog/timeout lines", len(bad), bad[0][:160] if bad else "")
    if sm:
        rep.add(f"{label} tokens/s", float(sm["tok_per_s"]), f"{sm.get('steps', '?')} steps")
    if rc != 0:
        rep.extra[f"{label}_log_tail"] = out[-4000:]
        rep.save()


def section_nccl(rep: Report, dry: bool, deadline: float) -> None:
    import torch  # was a NameError on a GPU machine: nothing at module level imports it

    gpus = 0 if dry else torch.cuda.device_count()
    rep.add("ranks", 2 if dry else gpus, "gloo on CPU (dry run)" if dry else "NCCL, one rank per GPU")
    if dry or gpus >= 2:
        packet_vs_raw(rep, dry)
    left = deadline - time.monotonic() - 10
    if dry:
        embedded_job(rep, "colocated", 2, ["dist.backend=gloo", "roles.mode=colocated", "train.epochs=2",
                                           "data.synthetic.num_samples=80", "data.synthetic.max_len=120"], left)
    elif gpus == 1:
        # sdpa: this run checks NCCL start to finish; flex compiles are the drafter section's subject.
        embedded_job(rep, "colocated", 1, ["dist.backend=nccl", "roles.mode=colocated", "train.epochs=1"], left,
                     env={"DFLASH_ATTN": "sdpa"})
    if gpus >= 3:
        embedded_job(rep, "2 drafters", min(gpus, 8), ["dist.backend=nccl", "roles.drafters_per_node=2",
                                                       "train.epochs=2"], left)


def section_hang(rep: Report, dry: bool, deadline: float) -> None:
    """Test hook: never ends, with a child in a session of its own (as torchrun's workers are)."""
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    rep.add("pids", f"{os.getpid()} {child.pid}")
    time.sleep(600)


def section_grads(rep: Report, dry: bool, deadline: float) -> None:
    from dflash_dist.bench.gpu_grads import section_grads as run
    run(rep, dry, deadline)


def section_overlap(rep: Report, dry: bool, deadline: float) -> None:
    from dflash_dist.bench.gpu_overlap import section_overlap as run
    cfg = reference_config(dry)
    run(rep, dry, deadline, cfg, plan_batches(cfg, dry)[0]["mean"])


def section_cost(rep: Report, dry: bool, deadline: float) -> None:
    from dflash_dist.bench.cost import section_cost as run
    run(rep, dry, deadline)


RUNNERS: dict[str, Callable[[Report, bool, float], None]] = {
    "env": section_env, "grads": section_grads, "drafter": section_drafter, "target": section_target,
    "cost": section_cost, "nccl": section_nccl, "overlap": section_overlap, "variants": section_variants,
    "hang": section_hang}


# -- main -------------------------------------------------------------------------------------------

def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, gloo: exercises every section")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, in order (default: all of {SECTIONS})")
    p.add_argument("--json", default="runs/bench/gpu_check.json")
    p.add_argument("--budget-s", type=ranged(float, gt=0), default=None, help="whole check (default 470 s on 1 GPU, 590 s on more)")
    p.add_argument("--timeouts", default="", help="per-section caps, e.g. drafter=300,nccl=120")
    p.add_argument("--section", help=argparse.SUPPRESS)  # a section's own process
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.names = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.names if s not in SECTIONS + HIDDEN]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {SECTIONS}")
    if not args.section:  # a section's own process writes its --result, which the parent gave it
        check_outputs(p, args)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.section:
        return run_one(RUNNERS[args.section], Path(args.result), args.dry_run, args.timeout_s)
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print("gpu_check: no CUDA device here. It measures GPUs; run it on a GPU machine, or pass --dry-run "
              "to exercise every section at tiny shapes on CPU.", file=sys.stderr)
        return 2
    gpus = 2 if args.dry_run else torch.cuda.device_count()
    caps = dict(CAPS, nccl=220 if gpus >= 2 and not args.dry_run else CAPS["nccl"])
    caps.update({k: float(v) for k, v in (item.split("=") for item in args.timeouts.split(",") if item)})
    budget = args.budget_s or BUDGET_S[min(gpus, 2)]
    t0 = time.perf_counter()
    results = run_sections("dflash_dist.bench.gpu_check", args.names, args.dry_run, budget, caps)
    total = time.perf_counter() - t0
    print_table(results)
    print(f"\ntotal {total:.0f} s (budget {budget:g} s){'; dry run on CPU' if args.dry_run else ''}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"dry_run": args.dry_run, "budget_s": budget, "total_s": total, "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": os.uname().nodename}
    sections = {name: {**{k: v for k, v in r.items() if k != "rows"},
                       "values": {m: v for m, v, _ in r["rows"]}, "notes": {m: n for m, _, n in r["rows"]}}
                for name, r in results.items()}
    out.write_text(json.dumps({"meta": meta, "sections": sections}, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
