"""The drafter's training state as one value: what a checkpoint saves and a resume restores.

Weights, optimizer, scheduler and RNG; the cursor (epoch, next batch of that epoch's plan); the run's
cumulative totals; and its history (finished epochs, tau before training, the wandb run id, time spent),
so that a resumed run's summary and wandb history cover the whole run, not only the last process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash_dist import checkpoint
from dflash_dist.checkpoint import Cursor
from dflash_dist.config import Config, to_dict
from dflash_dist.stats import StepStats
from dflash_dist.topology import Layout


@dataclass
class Totals:
    """Cumulative over the whole run (all processes of it)."""
    steps: int = 0  # optimizer steps taken (skipped non-finite steps included)
    batches: int = 0
    tokens: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    weight_sum: float = 0.0
    accept_sum: float = 0.0
    blocks: int = 0
    correct: list = field(default_factory=list)  # per block slot
    valid: list = field(default_factory=list)
    skipped_steps: int = 0  # steps not applied because the loss or gradient norm was not finite

    def add(self, s: StepStats) -> None:
        self.batches += s.batches
        self.tokens += s.tokens
        self.samples += s.seqs
        self.loss_sum += s.loss_sum
        self.weight_sum += s.weight_sum
        self.accept_sum += s.accept_sum
        self.blocks += s.blocks
        if not self.correct:
            self.correct, self.valid = [0.0] * len(s.correct), [0.0] * len(s.valid)
        self.correct = [a + float(b) for a, b in zip(self.correct, s.correct)]
        self.valid = [a + float(b) for a, b in zip(self.valid, s.valid)]

    def accuracy(self) -> list[float]:
        return [c / max(v, 1.0) for c, v in zip(self.correct[1:], self.valid[1:])]


@dataclass
class History:
    epochs: list = field(default_factory=list)  # {"epoch", "batches", "time_s", "loss"} per finished epoch
    tau_untrained: dict | None = None
    wandb_id: str | None = None
    train_time_s: float = 0.0  # training seconds of earlier processes of this run
    # Role timings of earlier processes (seconds, summed over ranks of the role).
    drafter_wait_s: float = 0.0
    drafter_compute_s: float = 0.0
    target_wait_s: float = 0.0
    target_compute_s: float = 0.0


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float):
    """Linear warmup then cosine decay to min_ratio, over the exact total of optimizer steps."""
    warmup = max(1, int(round(warmup_ratio * total_steps)))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cursor: Cursor
    totals: Totals = field(default_factory=Totals)
    history: History = field(default_factory=History)

    @classmethod
    def create(cls, model: nn.Module, cfg: Config, total_steps: int) -> "TrainState":
        o = cfg.optim
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                                betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, o.warmup_ratio, o.min_lr_ratio))
        return cls(model, opt, sched, Cursor(0, 0))

    def full_state(self, sharding, history: History | None = None) -> dict:
        """What a checkpoint holds, whole (a collective under FSDP: every drafter calls it)."""
        return {"drafter": sharding.full_model_state(), "optimizer": sharding.full_optim_state(self.optimizer),
                "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(),
                "totals": dataclasses.asdict(self.totals), "history": dataclasses.asdict(history or self.history)}

    def load(self, st: dict, sharding) -> None:
        sharding.load_full(self.optimizer, st["drafter"], st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["rng"])
        self.totals = Totals(**st["totals"])
        self.history = History(**st["history"])

    def meta(self, cfg: Config, layout: Layout, epoch_counts, plan_digests) -> dict:
        """meta.json: small, read by every rank (targets too) before the run starts."""
        c = self.cursor
        return {"cursor": {"epoch": c.epoch, "batch": c.batch}, "step": self.totals.steps,
                "layout": checkpoint.layout_meta(layout, cfg.model.target.tensor_parallel), "config": to_dict(cfg), "epoch_counts": list(epoch_counts),
                "plan_digests": list(plan_digests), "time": time.time()}

    def write(self, full: dict, cfg: Config, layout: Layout, epoch_counts, plan_digests) -> Path:
        """Rank 0 writes what `full_state` gathered. A non-finite weight is never written."""
        bad = [k for k, v in full["drafter"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise FloatingPointError(f"refusing to write a checkpoint with non-finite weights ({', '.join(bad[:3])})")
        return checkpoint.save_checkpoint(Path(cfg.train.run_dir), self.totals.steps, full,
                                          self.meta(cfg, layout, epoch_counts, plan_digests),
                                          keep_last=cfg.train.keep_last)


def weights_digest(state: dict) -> str:
    """Fingerprint of a (whole) drafter state dict."""
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
