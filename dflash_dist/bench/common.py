"""Timing helpers shared by the benchmarks: device-true wall time (CUDA work is asynchronous, so every
timed region starts and ends with a synchronisation), medians over repetitions."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from dflash_dist.observe.bars import track


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU, where every op has finished on return."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], reps: int, warmup: int, dev: torch.device) -> float:
    """Median seconds of `reps` calls of fn after `warmup` untimed ones."""
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


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int, dev: torch.device) -> dict:
    """Median seconds per call of each fn; the order rotates every repetition (the machines are shared
    and noisy, so no path always runs first or last)."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in track(range(warmup + reps), f"timing {', '.join(names)}", "rep", leave=False):
        for k in names[i % len(names):] + names[:i % len(names)]:
            sync(dev)
            t0 = time.perf_counter()
            fns[k]()
            sync(dev)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
