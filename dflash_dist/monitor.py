"""The rank-0 monitor: a daemon thread that reads counters and reports progress; and its sinks.

It never calls a collective or a send/recv (a thread that did could interleave with the main thread's
collectives and deadlock them): the main thread writes `Progress`, the monitor only reads it. Epoch
progress is measured against the count broadcast with this epoch's plan, overall progress against the
exact total of all epochs' counts.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Written by the main thread of rank 0 only; read by the monitor."""
    num_epochs: int
    epoch_counts: list[int]  # batches of every epoch, as planned at start
    epoch: int = 0
    epoch_batches: int = 0  # the count broadcast with this epoch's plan
    epoch_done: int = 0
    total_done: int = 0
    step: int = 0
    tokens: int = 0
    samples: int = 0
    loss: float = float("nan")
    acc: list[float] = field(default_factory=list)  # per block slot k >= 1
    accept_len: float = float("nan")
    lr: float = 0.0
    drafter_wait_s: float = 0.0  # summed over drafters
    drafter_compute_s: float = 0.0
    target_wait_s: float = 0.0  # summed over targets (from packet headers)
    target_compute_s: float = 0.0
    started: float = field(default_factory=time.time)
    resumed_done: int = 0  # batches / tokens done before this process started (resume)
    resumed_tokens: int = 0
    resumed_samples: int = 0

    @property
    def total_batches(self) -> int:
        return sum(self.epoch_counts)


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _frac(wait: float, compute: float) -> float:
    return wait / (wait + compute) if wait + compute > 0 else 0.0


def snapshot(p: Progress, device: torch.device) -> dict:
    elapsed = time.time() - p.started
    total = p.total_batches
    rec = {
        "time": round(elapsed, 3), "epoch": p.epoch + 1, "epochs": p.num_epochs,
        "batch": p.epoch_done, "batches_per_epoch": p.epoch_batches,
        "epoch_progress": p.epoch_done / p.epoch_batches if p.epoch_batches else 0.0,
        "total_progress": p.total_done / total if total else 0.0, "step": p.step,
        "tokens": p.tokens, "samples": p.samples,
        "tok_per_s": (p.tokens - p.resumed_tokens) / elapsed if elapsed > 0 else 0.0,
        "samples_per_s": (p.samples - p.resumed_samples) / elapsed if elapsed > 0 else 0.0,
        "eta_s": elapsed * (total - p.total_done) / (p.total_done - p.resumed_done)
        if p.total_done > p.resumed_done else float("inf"),
        "loss": p.loss, "acc": list(p.acc), "accept_len": p.accept_len, "lr": p.lr,
        "wait_targets": _frac(p.target_wait_s, p.target_compute_s),
        "wait_drafters": _frac(p.drafter_wait_s, p.drafter_compute_s),
        "rss_gib": psutil.Process().memory_info().rss / 2**30,
    }
    if device.type == "cuda":
        rec["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return rec


def format_line(r: dict) -> str:
    acc1 = r["acc"][0] if r["acc"] else float("nan")
    line = (f"epoch {r['epoch']}/{r['epochs']}  batch {r['batch']}/{r['batches_per_epoch']} "
            f"({100 * r['epoch_progress']:.0f}%)  total {100 * r['total_progress']:.0f}%  "
            f"{r['tok_per_s'] / 1e3:.1f}k tok/s  ETA {_fmt_eta(r['eta_s'])}  loss {r['loss']:.3f}  "
            f"acc@1 {acc1:.2f}  tau~{r['accept_len']:.2f}  "
            f"wait: targets {100 * r['wait_targets']:.0f}% drafters {100 * r['wait_drafters']:.0f}%  "
            f"rss {r['rss_gib']:.1f} GiB")
    if "gpu_mem_gib" in r:
        line += f"  gpu {r['gpu_mem_gib']:.1f} GiB"
    return line


class Sinks:
    """Console, JSONL in the run directory, and wandb (rank 0 only)."""

    def __init__(self, run_dir: Path, wandb_cfg, config_dict: dict):
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.wandb = None
        if wandb_cfg.mode != "disabled":
            import wandb
            self.wandb = wandb.init(project=wandb_cfg.project, name=wandb_cfg.name or None, mode=wandb_cfg.mode,
                                    dir=str(run_dir), config=config_dict)
        self.lock = threading.Lock()

    def write(self, rec: dict, console: bool = True) -> None:
        with self.lock:
            if console:
                log.info(format_line(rec) if "batch" in rec else json.dumps(rec))
            self.jsonl.write(json.dumps(rec) + "\n")
            if self.wandb is not None:
                flat = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and math.isfinite(v)}
                flat.update({f"acc/{k + 1}": a for k, a in enumerate(rec.get("acc", []))})
                self.wandb.log(flat, step=rec.get("step"))

    def close(self) -> None:
        with self.lock:
            self.jsonl.close()
            if self.wandb is not None:
                self.wandb.finish()
                self.wandb = None


class Monitor:
    def __init__(self, progress: Progress, sinks: Sinks, interval_s: float, device: torch.device):
        self.progress, self.sinks, self.interval_s, self.device = progress, sinks, interval_s, device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.progress.step > 0:
                self.report()

    def report(self, kind: str = "progress") -> dict:
        rec = snapshot(self.progress, self.device)
        rec["kind"] = kind
        self.sinks.write(rec)
        return rec

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
