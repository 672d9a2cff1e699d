"""Predicted seconds per batch of each role, the best target:drafter split and the job's throughput.

    python -m dflash_dist.bench.cost --config configs/qwen3_8b.yaml [key=value ...] [--gpus-per-node 8]
        [--nodes 1] [--device h200|h100|cpu] [--tflops X --mem-gbs Y ...] [--target-shape qwen3-8b]
        [--json OUT] [--validate]

The batches are those of the real plan (every epoch of the prepared dataset when data.path is set, else
of the 902K-sample reference chat mix), as `bench.memory` reads them; `dflash_dist.forecast.cost` says what each
term counts. One table: per role, TFLOP and predicted seconds of an average and of the worst batch; then
one row per drafters_per_node (the drafters' lockstep step, the batches/s, the bottleneck), and the
throughput and run time at the best and at the configured split.

--validate runs the real target capture (`capture.capture_for_drafter`) and the real drafter step
(`step.drafter_step` + AdamW) on CPU at two scaled shapes (`bench.memory.Scaled`, float32, sdpa path):
one where the target's work dominates, one where the drafter's does. Times are the minimum CPU time
of one thread over alternating repetitions (a shared machine's noise only adds). The CPU's own rates are measured first
(a matmul at the shapes' width, an element-wise pass over a large tensor), and the ratio of drafter to
target seconds that the model predicts with them is printed beside the measured one (target 0.7-1.4).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from dflash_dist.bench.common import timed
from dflash_dist.config import ConfigError, load_config, ranged
from dflash_dist.forecast import cost as C
from dflash_dist.forecast.memory import Precision
from dflash_dist.forecast.shapes import TARGET_SHAPES, check_target_split, layout_error, model_shapes
from dflash_dist.io.files import check_output_path, write_json

# target-heavy: a 9-layer capture, 8 anchors per sequence, one draft layer; drafter-heavy: a 3-layer
# capture, 48 anchors per sequence, two draft layers. Both: hidden 256, I = 3H, 4 sequences of 256 tokens
# (short contexts: matmuls dominate, and a step takes about a second on a loaded 2-core machine).
VALIDATE_SHAPES = {
    "target-heavy": dict(target_layers=10, num_anchors=8, draft_layers=1),
    "drafter-heavy": dict(target_layers=4, num_anchors=48, draft_layers=2),
}
VALIDATE_BASE = dict(vocab=2048, seqs=4, seq_len=256, prompt=32, anchor_chunk=0, loss_rows=2048)


# On a GPU: widths where matmuls fill the device, 8 sequences of 1,024 tokens, bf16 (drafter under autocast).
GPU_VALIDATE_BASE = dict(hidden=2048, intermediate=6144, heads=16, kv_heads=4, head_dim=128, vocab=32768, seqs=8,
                         seq_len=1024, prompt=64, anchor_chunk=0, loss_rows=8192, bf16=True)
GPU_VALIDATE_SHAPES = {
    "target-heavy": dict(target_layers=12, num_anchors=16, draft_layers=1),
    "drafter-heavy": dict(target_layers=4, num_anchors=128, draft_layers=3),
}
RATIO_RANGE = (0.7, 1.4)  # predicted / measured drafter:target time ratio


def rate_probes(sc, rows: int, dev) -> tuple[dict, dict]:
    """Probes of the device's rate for each kind of work at the scaled shape `sc` (bench.memory.Scaled), as
    ({name: fn}, {name: units of work per call}): a (rows, H) x (H, I) matmul; causal SDPA over one
    sequence without grad (the target's "ref" path's call); the drafter's "sdpa" path over SDPA_GROUP
    blocks against half a sequence of context, forward and backward; an in-place multiply over 64 MiB
    (bytes read and written). In the compute dtype of `sc` (bf16 or float32)."""
    import torch
    import torch.nn.functional as F

    from dflash_dist.forecast.memory import SDPA_GROUP
    from dflash_dist.models.attention import _sdpa_block
    dt = torch.bfloat16 if sc.bf16 else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, grad=False):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt, requires_grad=grad)

    a, b = rnd(rows, sc.hidden), rnd(sc.hidden, sc.intermediate)
    h, hkv, d, L = sc.heads, sc.kv_heads, sc.head_dim, sc.seq_len
    q, k, v = rnd(1, h, L, d), rnd(1, hkv, L, d), rnd(1, hkv, L, d)
    nq = SDPA_GROUP * 16
    keys = L // 2 + nq
    # the drafter's own "sdpa" path (models.attention._sdpa_block, as it runs on this device: on CUDA the
    # memory-efficient kernel with grouped heads folded) over one run of SDPA_GROUP blocks
    q_blk, k_blk, v_blk = rnd(SDPA_GROUP, 16, h, d, grad=True), rnd(SDPA_GROUP, 16, hkv, d), rnd(SDPA_GROUP, 16, hkv, d)
    k_ctx, v_ctx = rnd(L // 2, hkv, d, grad=True), rnd(L // 2, hkv, d, grad=True)
    ctx_end = torch.full((SDPA_GROUP,), L // 2, device=dev)
    runs = ((0, SDPA_GROUP, 0, L // 2),)
    x = rnd(1 << (24 if dt == torch.float32 else 25))

    def causal():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def block():
        _sdpa_block(q_blk, k_ctx, v_ctx, k_blk, v_blk, ctx_end, runs).float().sum().backward()

    fns = {"matmul": lambda: a @ b, "causal_attention": causal, "block_attention": block,
           "memory": lambda: x.mul_(1.0)}
    work = {"matmul": 2 * rows * sc.hidden * sc.intermediate, "causal_attention": 4 * h * d * L * (L + 1) / 2,
            "block_attention": 3 * 4 * h * d * nq * keys, "memory": 2 * x.numel() * x.element_size()}
    return fns, work


def measured_rates(seconds: dict, work: dict, name: str) -> tuple[C.Device, C.Efficiency]:
    """The probes' rates as a Device whose peak is the matmul's, the other kinds as efficiencies."""
    rate = {k: work[k] / seconds[k] for k in work}
    mm = rate["matmul"]
    return (C.Device(f"{name} (measured)", mm / 1e12, rate["memory"] / 1e9, 1.0, 1.0),
            C.Efficiency(matmul=1.0, causal_attention=rate["causal_attention"] / mm,
                         block_attention=rate["block_attention"] / mm, memory=1.0, link=1.0, network=1.0))


def scaled_job(sc, dev, overrides: tuple[str, ...] = ()):
    """(cfg, target, batch, anchors, anchor_cu, BatchShape with the drawn anchors) at scaled shape `sc`,
    with config `overrides` (key=value) on top."""
    import torch

    from dflash_dist.bench.memory import _batch
    from dflash_dist.forecast.memory import BatchShape
    from dflash_dist.models.qwen3 import TinyQwen3
    from dflash_dist.training.objective import anchor_generator, draw_anchors

    cfg = load_config(None, sc.overrides() + list(overrides))
    torch.manual_seed(0)
    target = TinyQwen3(cfg.model.target).to(dev, torch.bfloat16 if sc.bf16 else torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    batch = _batch(sc)
    anchors, anchor_cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, sc.num_anchors, anchor_generator(0, 0, 0))
    starts = torch.repeat_interleave(batch.cu_seqlens[:-1], anchor_cu.diff())
    shape = BatchShape(tokens=batch.num_tokens, seqs=batch.num_seqs, anchors=anchors.numel(),
                       seq_lens=tuple(batch.cu_seqlens.diff().tolist()), seq_anchors=tuple(anchor_cu.diff().tolist()),
                       anchor_pos=tuple((anchors - starts).tolist()))
    return cfg, target, batch.to(dev), anchors, anchor_cu, shape


def validate_shape(overrides: dict, reps: int = 3, device: str = "cpu") -> dict:
    """Predicted and measured seconds of one target capture and one drafter step (+ AdamW) at a scaled
    shape (on CPU: VALIDATE_BASE, float32; on CUDA: GPU_VALIDATE_BASE, bf16), both on the "sdpa" paths
    (nothing compiles), and their drafter:target ratios."""
    import torch

    from dflash_dist.bench.memory import Scaled
    from dflash_dist.models import attention as attn

    dev = torch.device(device)
    sc = Scaled(**((GPU_VALIDATE_BASE if dev.type == "cuda" else VALIDATE_BASE) | overrides))
    attn.backend.use("sdpa")
    try:
        return _measure_and_predict(sc, reps, dev)
    finally:
        attn.backend.use(None)


def _measure_and_predict(sc, reps: int, dev) -> dict:
    import torch

    from dflash_dist.forecast.memory import Sharding
    from dflash_dist.models.build import build_drafter, draft_spec
    from dflash_dist.training.capture import capture_for_drafter
    from dflash_dist.training.step import StepBatch, drafter_step, step_settings

    cfg, target, batch, anchors, anchor_cu, shape = scaled_job(sc, dev)
    spec = draft_spec(cfg, target)
    layer_ids = list(spec.target_layer_ids)
    model = build_drafter(spec, target, cfg.model.draft.seed, dev, False)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-4)
    dt = torch.bfloat16 if sc.bf16 else torch.float32
    settings = replace(step_settings(cfg, spec, torch.bfloat16 if sc.bf16 else None),
                       anchor_chunk=sc.anchor_chunk, loss_rows=sc.loss_rows, batch_mean=True)
    feats, labels = capture_for_drafter(target, batch, layer_ids, cfg.objective, dt)

    def run_drafter():
        drafter_step(model, StepBatch(batch, feats, labels, anchors, anchor_cu), settings)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # The probes alternate with the two roles: the rates are measured under the same load as the steps.
    # On CPU one thread: CPU time then counts work, not the spin-waits of idle intra-op threads.
    probes, work = rate_probes(sc, batch.num_tokens, dev)
    threads = torch.get_num_threads()
    try:
        if dev.type == "cpu":
            torch.set_num_threads(1)
        measured = min_interleaved({"target": lambda: capture_for_drafter(target, batch, layer_ids, cfg.objective, dt),
                                    "drafter": run_drafter, **probes}, reps, dev)
    finally:
        torch.set_num_threads(threads)
    rates, eff = measured_rates(measured, work, dev.type.upper())
    shapes, prec = model_shapes(cfg), replace(sc.precision, device=dev.type)
    one = Sharding(drafters=1, drafters_per_target=1)
    t = C.target_terms(shapes, prec, cfg, shape, one).seconds(rates, eff, exclude=("send",))
    d = C.drafter_terms(shapes, prec, cfg, shape, sc.anchor_chunk, one).seconds(rates, eff)
    return {"shape": {k: getattr(sc, k) for k in ("hidden", "target_layers", "draft_layers", "num_anchors", "seqs",
                                                  "seq_len", "vocab", "bf16")},
            "batch": shape.summary(), "device": {"tflops": rates.tflops, "mem_gbs": rates.mem_gbs,
                                                 "causal_attention": eff.causal_attention,
                                                 "block_attention": eff.block_attention},
            "predicted": {"target_s": t, "drafter_s": d, "ratio": d / t},
            "measured": {"target_s": measured["target"], "drafter_s": measured["drafter"],
                         "ratio": measured["drafter"] / measured["target"]}}


def min_interleaved(fns: dict, reps: int, dev=None) -> dict[str, float]:
    """Minimum seconds per call of each fn over `reps` alternating rounds, after one untimed round. On CPU,
    this process's CPU time, not wall time: on a shared machine the wall clock also counts the time other
    processes hold the cores, which no model of this work can predict. On CUDA, wall time between device
    synchronisations."""
    import torch
    cuda = dev is not None and torch.device(dev).type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    best = {k: float("inf") for k in fns}
    for i in range(reps + 1):
        for k, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = clock()
            fn()
            if cuda:
                torch.cuda.synchronize(dev)
            if i:
                best[k] = min(best[k], clock() - t0)
    return best


def validate(reps: int = 3, device: str = "cpu") -> dict[str, dict]:
    shapes = GPU_VALIDATE_SHAPES if device.startswith("cuda") else VALIDATE_SHAPES
    return {name: validate_shape(o, reps, device) for name, o in shapes.items()}


# -- bench.gpu_check's calibration ---------------------------------------------------------------------

def predicted_seconds(cfg, role: str, dev, lengths, seq_anchors=(), anchor_pos=(), attention: str = "flex") -> float:
    """The cost model's seconds for one batch of `role` as gpu_check runs it (one process: one drafter, no
    gradient sync, nothing sent), at the device's built-in peaks and the default efficiencies. Measured /
    predicted is then the factor by which the default efficiencies are off on this machine."""
    import torch

    from dflash_dist.forecast.memory import BatchShape, Precision, Sharding
    lengths = tuple(int(x) for x in lengths)
    w = BatchShape(tokens=sum(lengths), seqs=len(lengths), anchors=int(sum(seq_anchors)), seq_lens=lengths,
                   seq_anchors=tuple(int(x) for x in seq_anchors), anchor_pos=tuple(int(x) for x in anchor_pos))
    device = C.device_for(dev.type, torch.cuda.get_device_name(dev) if dev.type == "cuda" else "")
    prec = Precision.from_config(cfg, dev.type, attention=attention)
    one = Sharding(drafters=1, drafters_per_target=1)
    if role == "target":
        return C.target_terms(model_shapes(cfg), prec, cfg, w, one).seconds(device, C.Efficiency(), exclude=("send",))
    return C.drafter_terms(model_shapes(cfg), prec, cfg, w, cfg.objective.anchor_chunk, one).seconds(device, C.Efficiency())


def section_cost(rep, dry: bool, deadline: float) -> None:
    """gpu_check's "cost" section: `validate_shape` on the device (CUDA: GPU_VALIDATE_SHAPES in bf16; the
    dry run: the CPU shapes), a row per measurement, then the drafter:target ratio check. A ratio outside
    RATIO_RANGE fails the section (after its rows are written): the model's balance is off there."""
    device = "cpu" if dry else "cuda"
    bad = []
    for name, o in (VALIDATE_SHAPES if dry else GPU_VALIDATE_SHAPES).items():
        if time.monotonic() > deadline - 30:
            rep.add(f"{name}", "skipped", "the section's time is spent")
            continue
        r = validate_shape(o, reps=2 if dry else 3, device=device)
        p, m, d = r["predicted"], r["measured"], r["device"]
        q = p["ratio"] / m["ratio"]
        rep.add(f"{name} batch", f"{r['batch']['tokens']} tok, {r['batch']['anchors']} anchors", str(r["shape"]))
        rep.add(f"{name} target s pred|meas", f"{p['target_s']:.4g} | {m['target_s']:.4g}", "sdpa paths, min of reps")
        rep.add(f"{name} drafter s pred|meas", f"{p['drafter_s']:.4g} | {m['drafter_s']:.4g}", "step + AdamW")
        rep.add(f"{name} ratio pred/meas", q, f"drafter:target predicted {p['ratio']:.3g}, measured {m['ratio']:.3g}; "
                                              f"target {RATIO_RANGE[0]}-{RATIO_RANGE[1]}")
        rep.add(f"{name} probed rates", f"{d['tflops']:.3g} TFLOP/s", f"{d['mem_gbs']:.0f} GB/s; attention vs matmul: "
                f"causal {d['causal_attention']:.2f}, block {d['block_attention']:.2f}")
        if not RATIO_RANGE[0] <= q <= RATIO_RANGE[1]:
            bad.append(f"{name} {q:.2f}")
    if bad:
        raise AssertionError(f"cost model: predicted/measured drafter:target ratio outside {RATIO_RANGE}: {', '.join(bad)}")


# -- CLI ----------------------------------------------------------------------------------------------

def _table(rows: list[list[str]]) -> str:
    width = [max(len(x) for x in col) for col in zip(*rows)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, width)) for r in rows)


def report(fc: C.Forecast) -> str:
    """The roles, the splits and the throughput, as text."""
    pb = fc.per_batch
    roles = [["role", "TFLOP/batch", "GB moved", "s/batch", "worst TFLOP", "worst GB", "worst s"]] + [
        [r, _g(v['tflop']), _g(v['gbytes']), _g(v['avg_s']), _g(v['worst_tflop']), _g(v['worst_gbytes']),
         _g(v['worst_s'])] for r, v in pb.items()]
    splits = [["drafters/node", "target replicas", "drafter step s", "batches/s", "samples/s", "bottleneck"]] + [
        [str(x["drafters_per_node"]) + (" (best)" if x is fc.best else "")
         + (" (config)" if x["drafters_per_node"] == fc.configured else ""),
         str(x["target_replicas_per_node"]), _g(x['drafter_step_s']), _g(x['batches_per_s']),
         _g(x['batches_per_s'] * fc.ps.samples_per_batch), x["bottleneck"]] for x in fc.splits]
    lines = [_table(roles), "", _table(splits), ""]
    for label, d in (("best", fc.best["drafters_per_node"]), ("configured", fc.configured)):
        if d is None or d not in [x["drafters_per_node"] for x in fc.splits]:
            continue
        t = fc.throughput(d)
        lines.append(f"{label} roles.drafters_per_node={d}: {_g(t['samples_per_s'])} samples/s, "
                     f"{_g(t['tokens_per_s'])} tokens/s, useful-FLOP utilisation {_g(100 * t['mfu'])}%, "
                     f"{fc.ps.batches:,} batches in {_g(t['run_hours'])} h")
    if fc.configured is not None and fc.configured == fc.best["drafters_per_node"]:
        lines.append("the configured split is the best")
    elif fc.slowdown is not None:
        lines.append(f"the configured split is predicted {fc.slowdown:.2f}x slower than the best")
    return "\n".join(lines)


def _g(x: float) -> str:
    """Three significant digits, thousands grouped: 0.00041 TFLOP of a small model is not 0, 1.2e+04 is 12,000."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _validate_report(v: dict) -> str:
    rows = [["shape", "tokens", "anchors", "pred target s", "pred drafter s", "pred ratio", "meas target s",
             "meas drafter s", "meas ratio", "pred/meas"]]
    for name, r in v.items():
        p, m = r["predicted"], r["measured"]
        rows.append([name, str(r["batch"]["tokens"]), str(r["batch"]["anchors"]), f"{p['target_s']:.3f}",
                     f"{p['drafter_s']:.3f}", f"{p['ratio']:.3f}", f"{m['target_s']:.3f}", f"{m['drafter_s']:.3f}",
                     f"{m['ratio']:.3f}", f"{p['ratio'] / m['ratio']:.3f}"])
    return ("validate on CPU (float32, sdpa path; CPU seconds, min of alternating repetitions; drafter:target "
            "ratio target 0.7-1.4):\n" + _table(rows))


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.bench.cost", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--gpus-per-node", type=ranged(int, ge=1), default=8,
                    help="ranks per node (with --device cpu: processes on this machine)")
    ap.add_argument("--nodes", type=ranged(int, ge=1), default=1)
    ap.add_argument("--device", default="h200", choices=sorted(C.DEVICES),
                    help="built-in peaks of a GPU, or cpu: this machine's rates, measured at the config's "
                         "widths (and its float32 dtypes)")
    for name, what in (("tflops", "dense bf16 TFLOP/s"), ("mem-gbs", "HBM GB/s"), ("link-gbs", "GPU-GPU GB/s in a node"),
                       ("net-gbs", "GB/s per GPU between nodes")):
        ap.add_argument(f"--{name}", type=ranged(float, gt=0), help=f"{what} (overrides --device's)")
    for kind in C.Efficiency.__dataclass_fields__:
        ap.add_argument(f"--eff-{kind.replace('_', '-')}", type=ranged(float, gt=0, le=1),
                        help=f"efficiency of {kind} work (share of the peak)")
    ap.add_argument("--target-shape", choices=sorted(TARGET_SHAPES),
                    help="built-in target shape when model.target.path has no config.json")
    ap.add_argument("--json", help="write the prediction here")
    ap.add_argument("--validate", action="store_true", help="also check the model against the real code on CPU")
    return ap.parse_args(argv)


def device_and_eff(args, cfg=None, shapes=None) -> tuple[C.Device, C.Efficiency]:
    """The device's peaks and the efficiencies: --device's (cpu: this machine's, measured at the config's
    widths by `measure_cpu`), each overridden by the flags given."""
    if args.device == "cpu":
        dev, eff = measure_cpu(shapes, args.gpus_per_node)
    else:
        dev, eff = C.DEVICES[args.device], C.Efficiency()
    dev = replace(dev, **{f: getattr(args, f) for f in ("tflops", "mem_gbs", "link_gbs", "net_gbs")
                          if getattr(args, f) is not None})
    eff = replace(eff, **{k: getattr(args, f"eff_{k}") for k in C.Efficiency.__dataclass_fields__
                          if getattr(args, f"eff_{k}") is not None})
    return dev, eff


CPU_PROBE = dict(seq_len=512, rows=512)  # tokens of the probes' matmul and attention: short, widths are the model's


def measure_cpu(shapes, ranks: int) -> tuple[C.Device, C.Efficiency]:
    """This machine's rates as one of `ranks` processes sharing it would see them: `rate_probes` at the
    target's widths (float32, what a CPU run computes in), timed by wall clock on this process's share of
    torch's threads. Links between ranks are the nominal CPU device's (gloo over loopback is not probed)."""
    import torch

    from dflash_dist.bench.memory import Scaled
    sc = Scaled(hidden=shapes.hidden, intermediate=shapes.intermediate, heads=shapes.heads, kv_heads=shapes.kv_heads,
                head_dim=shapes.head_dim, seq_len=CPU_PROBE["seq_len"])
    dev = torch.device("cpu")
    probes, work = rate_probes(sc, CPU_PROBE["rows"], dev)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads // ranks))
        seconds = {k: timed(fn, reps=3, warmup=1, dev=dev) for k, fn in probes.items()}
    finally:
        torch.set_num_threads(threads)
    measured, eff = measured_rates(seconds, work, "CPU")
    nominal = C.DEVICES["cpu"]
    return replace(measured, link_gbs=nominal.link_gbs, net_gbs=nominal.net_gbs), eff


def check_layout(cfg, shapes, args) -> str | None:
    """ValueError for a target the run could not split (a head cut by tensor_parallel) or nodes with no
    split at all; else the reason the configured roles.drafters_per_node cannot exist on these nodes, or
    None: the run's own layout checks (forecast.shapes)."""
    check_target_split(cfg, shapes)
    tp = cfg.model.target.tensor_parallel
    if not C.candidate_splits(args.gpus_per_node, tp):
        raise ValueError(f"--gpus-per-node {args.gpus_per_node} leaves no split for model.target.tensor_parallel="
                         f"{tp} (a drafter and a whole target replica per node)")
    return None if cfg.roles.mode == "colocated" else layout_error(cfg, args.gpus_per_node, args.nodes)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.json:  # before the forecast (and --validate's minutes): a bad path is bad input, not a traceback
            check_output_path(args.json, "--json", make_parents=True)
        cfg = load_config(args.config, args.overrides)
        shapes = model_shapes(cfg, args.target_shape)
        configured_problem = check_layout(cfg, shapes, args)
        dev, eff = device_and_eff(args, cfg, shapes)
        prec = Precision.from_config(cfg, "cpu") if args.device == "cpu" else None
        fc = C.forecast(cfg, shapes, C.plan_sample_for(cfg), dev, eff, args.gpus_per_node, args.nodes, prec)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kind = "CPU processes" if args.device == "cpu" else "GPUs"
    print(f"{args.config} {' '.join(args.overrides)}\ntarget shape: {shapes.source}\nbatches: {fc.ps.source}; "
          f"{fc.ps.batches:,} over {cfg.train.epochs} epochs, {fc.ps.tokens_per_batch:,.0f} tokens, "
          f"{fc.ps.anchors_per_batch:,.0f} anchors, {fc.ps.samples_per_batch:.1f} samples per batch\n"
          f"device {dev.name}: {_g(dev.tflops)} TFLOP/s, {_g(dev.mem_gbs)} GB/s; {args.nodes} x {args.gpus_per_node} "
          f"{kind}; efficiency {', '.join(f'{k} {v:.2g}' for k, v in eff.__dict__.items())}\n")
    print(report(fc))
    if configured_problem:
        print(f"the configured split cannot exist on {args.gpus_per_node} {kind} per node: {configured_problem}")
    result = fc.to_json() | {"efficiency": eff.__dict__, "config": args.config, "overrides": args.overrides,
                             "configured_problem": configured_problem}
    if args.validate:
        print("\nvalidating the cost model against the real code on CPU at two built-in scaled shapes (not the "
              "config's), a minute or more...", flush=True)
        v = validate()
        print("\n" + _validate_report(v))
        result["validate"] = v
    if args.json:
        write_json(Path(args.json), result, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
