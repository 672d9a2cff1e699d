"""bench.gpu_check's "overlap" section: how much of a drafter step's gradient all-reduce DDP hides.

Under roles.drafter_sharding=ddp (parallel/sharding.py `Replicas`) the last anchor chunk's backward
all-reduces each of DDP's gradient buckets as soon as its gradients are ready, while the backward of the
layers below it still runs. On W ranks, one per GPU (NCCL), every rank times on the same batch (the plan's
mean at the reference shape, as the drafter section's) and its own copy of the reference drafter:
  compute    the step's forward and backward alone, no reduction (the bare module, as in no_sync)
  serial     the same, then one all-reduce of every gradient as one flat buffer after the backward (the
             project's replicas before DDP: nothing overlapped, two copies of every gradient)
  ddp        the step as the run makes it (`training.step.step_gradients`)
  all-reduce the gradients' flat all-reduce alone
hidden = (serial - ddp) / all-reduce: the share of the all-reduce that DDP overlaps with the backward (1:
all of it, 0: none; below 0 where DDP's bucketing costs more than it hides). Medians of REPS steps after a
warm-up step (which compiles the attention), each started after a barrier; rank 0's figures. NCCL refuses
two ranks on one GPU, so one GPU reports the compute step only. The dry run: 2 gloo ranks on CPU at tiny
shapes, where the two processes share the cores and nothing can overlap (the figures only show it runs).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPS = {False: 5, True: 2}  # GPU / dry run
CASES = ("compute", "serial", "ddp", "all-reduce")


def _flat_all_reduce(params) -> None:
    """The pre-DDP replicas' reduction: one flat copy of every gradient, summed, copied back."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()


def _cases(model, sharding, batch, settings) -> dict:
    """The four timed callables of one rank (module docstring)."""
    import torch
    import torch.distributed as dist

    from dflash_dist.training.step import drafter_step, step_gradients

    params = sharding.params
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)

    def compute():
        sharding.begin_step()
        drafter_step(model, batch, settings, scale=float(sharding.size))

    def serial():
        compute()
        _flat_all_reduce(params)

    def ddp():
        step_gradients(sharding, batch, settings, lambda: batch)

    return {"compute": compute, "serial": serial, "ddp": ddp, "all-reduce": lambda: dist.all_reduce(buffer)}


def _time(fn, model, reps: int, dev) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up run; gradients zeroed in place before
    each (DDP's bucket views stay its buckets), every rank starting together."""
    import torch.distributed as dist

    from dflash_dist.bench.common import sync

    times = []
    for i in range(reps + 1):
        model.zero_grad(set_to_none=False)
        sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, store: str, dry: bool, job: tuple, out: str) -> None:
    """One rank of the section: the reference drafter under DDP, the four cases timed; rank 0 writes them.
    `job`: (the reference config, the batch's sequence lengths and supervised counts)."""
    import torch
    import torch.distributed as dist

    from dflash_dist.bench.gpu_setup import packed_batch, reference_drafter
    from dflash_dist.parallel.sharding import Replicas
    from dflash_dist.parallel.transport import packet_spec
    from dflash_dist.training.objective import draw_anchors
    from dflash_dist.training.step import StepBatch, drafter_autocast, step_settings

    dev = torch.device("cpu") if dry else torch.device("cuda", rank)
    if dry:
        torch.set_num_threads(1)  # the ranks share the cores
    else:
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo" if dry else "nccl", init_method=store, rank=rank, world_size=world)
    try:
        cfg, (lengths, supervised) = job
        compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
        torch.manual_seed(0)
        spec, model = reference_drafter(cfg, dev, compute)
        sharding = Replicas(model, dist.group.WORLD, dev)
        settings = replace(step_settings(cfg, spec, drafter_autocast(dev)), batch_mean=False)
        data = packed_batch(lengths, supervised, spec.vocab_size, dev)
        anchors, anchor_cu = draw_anchors(data.loss_mask, data.cu_seqlens, cfg.objective.num_anchors,
                                          torch.Generator().manual_seed(1))
        feats = torch.randn(data.num_tokens, packet_spec(cfg, spec, dev).feat_dim, device=dev, dtype=compute)
        batch = StepBatch(data, feats, None, anchors.to(dev), anchor_cu.to(dev))
        cases = _cases(model, sharding, batch, settings)
        seconds = {name: _time(fn, model, REPS[dry], dev) for name, fn in cases.items()}
        if rank == 0:
            Path(out).write_text(json.dumps({
                "seconds": seconds, "params": sum(p.numel() for p in sharding.params), "tokens": data.num_tokens,
                "anchors": int(anchors.numel()), "chunk": cfg.objective.anchor_chunk}))
        # Neither rank leaves before the other has received the last all-reduce: a rank that closes its
        # gloo pairs early aborts its peer mid-read (SIGABRT, seen once in the dry run under load).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_gpu(rep, dry: bool) -> None:
    """One GPU: no second rank to reduce with (NCCL refuses two on one device)."""
    rep.add("ranks", 1, "NCCL needs a GPU per rank: the overlap needs 2+ GPUs")
    rep.add("hidden share", "n/a", "one GPU: nothing to all-reduce")


def section_overlap(rep, dry: bool, deadline: float, cfg, batch) -> None:
    """`cfg`: gpu_check's reference config; `batch`: (lengths, supervised) of its plan's mean batch."""
    import torch
    import torch.multiprocessing as mp

    world = 2 if dry else min(torch.cuda.device_count(), 8)
    if world < 2:
        return _one_gpu(rep, dry)
    with tempfile.TemporaryDirectory(prefix="gpu-check-overlap-") as d:
        out = os.path.join(d, "overlap.json")
        mp.spawn(_rank, args=(world, f"file://{d}/store", dry, (cfg, batch), out), nprocs=world, join=True)
        r = json.loads(Path(out).read_text())
    s = r["seconds"]
    rep.add("ranks", world, "gloo on CPU (dry run): the ranks share the cores" if dry else "NCCL, one rank per GPU")
    rep.add("batch", f"{r['tokens']} tok, {r['anchors']} anchors", f"anchor chunk {r['chunk'] or 'all'}; "
            f"{r['params'] / 1e6:.1f} M trained parameters")
    for name in CASES:
        rep.add(f"{name} s", s[name], f"median of {REPS[dry]}, rank 0")
    hidden = (s["serial"] - s["ddp"]) / s["all-reduce"] if s["all-reduce"] > 0 else float("nan")
    rep.add("hidden share", hidden, "(serial - ddp) / all-reduce: 1 all of it overlapped, 0 none")
    rep.add("ddp / compute", s["ddp"] / s["compute"], "what the reduction adds to the step as the run makes it")
