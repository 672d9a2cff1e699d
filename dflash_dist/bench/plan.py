"""Batch plan at scale: build time, fill and shape per epoch, two reference strategies, broadcast time.

    python -m dflash_dist.bench.plan --samples 902000 --epochs 6 [--json runs/bench/plan.json]

Lengths are a seeded two-component log-normal mix of chat samples (55% short exchanges around 900
tokens, 45% long or reasoning ones around 3,000; median ~1.5K, long tail capped at the budget), 50-80%
of each supervised, plus a few samples over the budget so the skip counts show.

  plan      build_plan: full shuffle, greedy packing under the real-token budget (what training runs,
            with --packing, default plan.packing = fill)
  next-fit  build_plan(packing="next_fit") on the same shuffles: the plain rule, for comparison
  sorted    sort by length once, pack greedily once, shuffle only the batch order each epoch
  padded    shuffle, then batches padded to their longest sequence, under the same budget counted in
            padded tokens (what a padding collator needs to fit the same memory)

fill = real tokens / (batches * token_budget); for padded, also real / computed (padded) tokens.
The broadcast is timed on `--ranks` real gloo processes on 127.0.0.1 (median of `--reps`, each the
slowest rank's time from a barrier to holding the plan). Timings are wall clock; the CPU time of the
build is shown too because the machines are shared (other processes inflate wall time, not CPU time).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from bisect import bisect_right
from pathlib import Path

import numpy as np

from dflash_dist.bench.jobs import check_outputs
from dflash_dist.config import PlanConfig, ranged
from dflash_dist.data.synthetic import chat_lengths
from dflash_dist.observe.bars import track
from dflash_dist.plan.epochs import PACKINGS, BatchPlan, build_plan

TARGET_BUILD_S, TARGET_FILL, TARGET_BCAST_S = 0.25, 0.95, 1.0


def greedy_offsets(lengths: np.ndarray, token_budget: int, max_seqs: int) -> np.ndarray:
    """Batch offsets of the greedy packing of `lengths` in the given order (the plan's rule)."""
    cum = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cum[1:])
    view, n, starts, s = memoryview(cum), len(lengths), [0], 0
    while s < n:
        s = bisect_right(view, view[s] + token_budget, s, min(s + max_seqs, n) + 1) - 1
        starts.append(s)
    return np.asarray(starts, dtype=np.int64)


def padded_batches(lengths: np.ndarray, token_budget: int, max_seqs: int) -> tuple[int, int]:
    """(batches, computed tokens) when every batch is padded to its longest sequence."""
    batches = computed = count = longest = 0
    for length in lengths.tolist():
        if count and ((count + 1) * max(longest, length) > token_budget or count == max_seqs):
            batches, computed, count, longest = batches + 1, computed + count * longest, 0, 0
        count, longest = count + 1, max(longest, length)
    if count:
        batches, computed = batches + 1, computed + count * longest
    return batches, computed


def shape(lengths: np.ndarray, indices: np.ndarray, offsets: np.ndarray, token_budget: int) -> dict:
    seqs = np.diff(offsets)
    return {"batches": int(len(seqs)), "fill": float(lengths[indices].sum() / (len(seqs) * token_budget)),
            "seqs_min": int(seqs.min()), "seqs_median": float(np.median(seqs)), "seqs_max": int(seqs.max())}


def timed(fn, *args, **kwargs):
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - w, time.process_time() - c


# ------------------------------------------------------------------------------------------ broadcast

def _broadcast_worker(rank: int, world: int, port: int, plan: BatchPlan, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from dflash_dist.plan.epochs import broadcast_plan
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times = []
    for _ in range(reps + 1):  # the first one warms up the connections
        dist.barrier()
        t0 = time.perf_counter()
        got = broadcast_plan(plan if rank == 0 else None, src=0)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if not (np.array_equal(got.offsets, plan.offsets) and np.array_equal(got.indices, plan.indices)):
            raise RuntimeError(f"rank {rank} received a different plan")
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    if rank == 0:
        Path(out).write_text(json.dumps(times[1:]))
    dist.destroy_process_group()


def time_broadcast(plan: BatchPlan, ranks: int, reps: int, scratch: Path) -> list[float]:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = scratch / f"bcast-{os.getpid()}.json"
    mp.spawn(_broadcast_worker, args=(ranks, port, plan, reps, str(out)), nprocs=ranks, join=True)
    times = json.loads(out.read_text())
    out.unlink()
    return times


# ------------------------------------------------------------------------------------------ main

def run(samples: int, epochs: int, token_budget: int, max_seqs: int, seed: int, ranks: int, reps: int,
        scratch: Path, packing: str = PlanConfig.packing) -> dict:
    lengths, supervised = chat_lengths(samples, token_budget, seed)
    kw = dict(seed=seed, token_budget=token_budget, max_seqs=max_seqs)
    res: dict = {"samples": samples, "epochs": epochs, "token_budget": token_budget, "max_seqs": max_seqs,
                 "packing": packing,
                 "seed": seed, "lengths": {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                                           "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max())},
                 "plan": [], "next_fit": [], "sorted": [], "padded": []}
    plans, shuffles = [], []
    for e in track(range(epochs), f"plan: {samples:,} samples, {packing} and next_fit", "epoch"):
        plan, wall, cpu = timed(build_plan, lengths, supervised, epoch=e, packing=packing, **kw)
        plans.append(plan)
        res["plan"].append({"epoch": e, "build_s": wall, "build_cpu_s": cpu,
                            **shape(lengths, plan.indices, plan.offsets, token_budget)})
        nf, wall, _ = timed(build_plan, lengths, supervised, epoch=e, packing="next_fit", **kw)
        shuffles.append(nf.indices)  # next-fit keeps the shuffled order: the padded reference's input
        res["next_fit"].append({"epoch": e, "build_s": wall, **shape(lengths, nf.indices, nf.offsets, token_budget)})
    res["skipped"] = plans[0].skipped
    kept = plans[0].indices  # any epoch: the same samples

    # sorted: longest first (ties by index), packed once; each epoch only reorders whole batches.
    t0 = time.perf_counter()
    by_len = kept[np.lexsort((kept, -lengths[kept]))]
    offsets = greedy_offsets(lengths[by_len], token_budget, max_seqs)
    res["sorted_once_s"] = time.perf_counter() - t0
    for e in range(epochs):
        t0 = time.perf_counter()
        np.random.default_rng([seed, e]).permutation(len(offsets) - 1)
        res["sorted"].append({"epoch": e, "build_s": time.perf_counter() - t0,
                              **shape(lengths, by_len, offsets, token_budget)})

    # padded: the same shuffle as the plan, batches cut when the padded size would overflow.
    for e in range(epochs):
        order = shuffles[e]
        (batches, computed), wall, _ = timed(padded_batches, lengths[order], token_budget, max_seqs)
        real = int(lengths[order].sum())
        res["padded"].append({"epoch": e, "build_s": wall, "batches": batches,
                              "fill": real / (batches * token_budget), "real_over_computed": real / computed,
                              "extra_compute": computed / real})
    if ranks > 1:
        times = time_broadcast(plans[0], ranks, reps, scratch)
        res["broadcast"] = {"ranks": ranks, "reps": reps, "median_s": statistics.median(times), "max_s": max(times),
                            "batches": len(plans[0]), "indices": int(len(plans[0].indices))}
    return res


def report(res: dict) -> str:
    b = res["token_budget"]
    lines = [f"{res['samples']:,} samples, lengths median {res['lengths']['median']:,.0f} / mean "
             f"{res['lengths']['mean']:,.0f} / p99 {res['lengths']['p99']:,.0f} tokens; budget {b:,} tokens, "
             f"max_seqs {res['max_seqs']}, packing {res['packing']}; skipped {res['skipped']}", "",
             "| epoch | build s (wall) | build s (CPU) | batches | fill | seqs/batch min / median / max |",
             "|---:|---:|---:|---:|---:|---|"]
    for r in res["plan"]:
        lines.append(f"| {r['epoch']} | {r['build_s']:.3f} | {r['build_cpu_s']:.3f} | {r['batches']:,} | "
                     f"{r['fill']:.2%} | {r['seqs_min']} / {r['seqs_median']:g} / {r['seqs_max']} |")
    mean = lambda rows, k: statistics.mean(r[k] for r in rows)  # noqa: E731
    pl, nf, so, pa = res["plan"], res["next_fit"], res["sorted"], res["padded"]
    lines += ["", "| strategy (mean over epochs) | build s | batches | fill | real / computed | extra compute |",
              "|---|---:|---:|---:|---:|---:|",
              f"| plan ({res['packing']}): shuffle + greedy packing | {mean(pl, 'build_s'):.3f} | "
              f"{mean(pl, 'batches'):,.0f} | {mean(pl, 'fill'):.2%} | 100% | 1.00x |",
              f"| plan (next_fit), same shuffles | {mean(nf, 'build_s'):.3f} | {mean(nf, 'batches'):,.0f} | "
              f"{mean(nf, 'fill'):.2%} | 100% | 1.00x |",
              f"| sorted by length, packed once | {res['sorted_once_s']:.3f} once, then {mean(so, 'build_s'):.4f} | "
              f"{mean(so, 'batches'):,.0f} | "
              f"{mean(so, 'fill'):.2%} | 100% | 1.00x |",
              f"| shuffle + pad to longest | {mean(pa, 'build_s'):.3f} | {mean(pa, 'batches'):,.0f} | "
              f"{mean(pa, 'fill'):.2%} | {mean(pa, 'real_over_computed'):.2%} | {mean(pa, 'extra_compute'):.2f}x |"]
    if "broadcast" in res:
        bc = res["broadcast"]
        lines += ["", f"broadcast_plan to {bc['ranks']} gloo ranks ({bc['batches']:,} batches, {bc['indices']:,} "
                      f"indices): median {bc['median_s']:.3f} s, max {bc['max_s']:.3f} s over {bc['reps']} reps"]
    worst_build = max(r["build_s"] for r in pl)
    lines += ["", f"targets: build <= {TARGET_BUILD_S} s/epoch: worst {worst_build:.3f} s "
                  f"({'met' if worst_build <= TARGET_BUILD_S else 'MISSED'}); fill >= {TARGET_FILL:.0%}: worst "
                  f"{min(r['fill'] for r in pl):.2%} ({'met' if min(r['fill'] for r in pl) >= TARGET_FILL else 'MISSED'})"
              + (f"; broadcast < {TARGET_BCAST_S} s: {res['broadcast']['max_s']:.3f} s "
                 f"({'met' if res['broadcast']['max_s'] < TARGET_BCAST_S else 'MISSED'})" if "broadcast" in res else "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.bench.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=ranged(int, ge=1), default=902_000)
    ap.add_argument("--epochs", type=ranged(int, ge=1), default=6)
    ap.add_argument("--token-budget", type=ranged(int, ge=1), default=49_152)
    ap.add_argument("--max-seqs", type=ranged(int, ge=1), default=64)
    ap.add_argument("--seed", type=ranged(int, ge=0), default=0)
    ap.add_argument("--ranks", type=ranged(int, ge=0), default=8,
                    help="gloo processes for the broadcast timing (0: skip)")
    ap.add_argument("--reps", type=ranged(int, ge=1), default=5, help="timed broadcasts")
    ap.add_argument("--packing", default=PlanConfig.packing, choices=PACKINGS, help="plan.packing")
    ap.add_argument("--json", default="runs/bench/plan.json", help="where to write the results")
    args = ap.parse_args(argv)
    check_outputs(ap, args)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    res = run(args.samples, args.epochs, args.token_budget, args.max_seqs, args.seed, args.ranks, args.reps,
              out.parent, args.packing)
    res["machine"] = {"cpus": os.cpu_count(), "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0]}
    out.write_text(json.dumps(res, indent=2))
    print(report(res))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
