"""The drafter's training state as one value: what a checkpoint saves and a resume restores.

Weights, optimizer, scheduler and RNG; the cursor (epoch, next batch of that epoch's plan); the run's
cumulative totals; and its history (finished epochs, tau before training, the wandb run id, time spent),
so that a resumed run's summary and wandb history cover the whole run, not only the last process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash_dist.checkpoints import store as checkpoint
from dflash_dist.config import Config, to_dict
from dflash_dist.models.variants import RunProgress
from dflash_dist.parallel.topology import Layout
from dflash_dist.plan.schedule import Cursor
from dflash_dist.training.stats import StepStats, drafting_slots

log = logging.getLogger(__name__)


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
    # The last step applied with a finite loss and gradient norm: the weights of every earlier step were
    # used by a finite step (skipped steps leave the weights as they were), those of this one not yet.
    last_finite_step: int = 0

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
        first = drafting_slots(self.valid) if self.valid else 1
        return [c / max(v, 1.0) for c, v in zip(self.correct[first:], self.valid[first:])]


@dataclass
class History:
    epochs: list = field(default_factory=list)  # {"epoch", "batches", "time_s", "loss"} per finished epoch
    tau_untrained: dict | None = None
    taus: list = field(default_factory=list)  # every tau measured in the run, with its step
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


@dataclass(frozen=True)
class ScheduleClock:
    """Where the run's schedules (the learning rate's warm-up and cosine, Domino's lambda) stand: a
    position in [0, horizon] for each optimizer step. A fresh run's position is its step (horizon = its
    total). A resume on another layout (another drafter count: another total of steps) keeps the schedules
    where the checkpoint left them and spreads what remains of them over the steps left: from the resumed
    step `anchor` at position `anchor_pos`, linearly to `horizon` at the new `total`. A resume on the same
    total is the identity (bitwise the uninterrupted run)."""
    horizon: int  # the schedules' length: the first process's total of optimizer steps
    total: int  # this process's total of optimizer steps
    anchor: int = 0
    anchor_pos: float = 0.0

    def position(self, step: int) -> float:
        if self.total == self.horizon and self.anchor_pos == self.anchor:
            return step
        if self.total <= self.anchor:
            return float(self.horizon)
        return self.anchor_pos + (step - self.anchor) * (self.horizon - self.anchor_pos) / (self.total - self.anchor)

    def resumed(self, step: int, total: int) -> "ScheduleClock":
        """This clock continued at `step` by a process of `total` steps."""
        if total == self.total:
            return self
        return ScheduleClock(self.horizon, total, step, self.position(step))


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    cursor: Cursor
    totals: Totals = field(default_factory=Totals)
    history: History = field(default_factory=History)
    clock: ScheduleClock = ScheduleClock(0, 0)
    lr_shape: tuple[float, float] = (0.0, 0.0)  # optim.warmup_ratio, optim.min_lr_ratio

    @classmethod
    def create(cls, model: nn.Module, cfg: Config, total_steps: int) -> "TrainState":
        o = cfg.optim
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                                betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        state = cls(model, opt, None, Cursor(0, 0), clock=ScheduleClock(total_steps, total_steps),
                    lr_shape=(o.warmup_ratio, o.min_lr_ratio))
        # A function (not a callable object), so that LambdaLR saves no state of it: the clock is saved
        # apart and read at every step, so that a resume can continue it.
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: state.lr_factor(step))
        return state

    def lr_factor(self, step: int) -> float:
        return lr_lambda(self.clock.horizon, *self.lr_shape)(self.clock.position(step))

    def progress(self, steps_taken: int) -> RunProgress:
        """The place in the run of the step after `steps_taken`, as a variant's schedule reads it (Domino's
        lambda): its position on the schedule clock, of the schedule's horizon."""
        return RunProgress(self.clock.position(steps_taken), self.clock.horizon)

    def full_state(self, sharding, history: History | None = None) -> dict:
        """What a checkpoint holds, whole (a collective under FSDP: every drafter calls it)."""
        return {"drafter": sharding.full_model_state(), "optimizer": sharding.full_optim_state(self.optimizer),
                "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(),
                "schedule": dataclasses.asdict(self.clock),
                "totals": dataclasses.asdict(self.totals), "history": dataclasses.asdict(history or self.history)}

    def load(self, st: dict, sharding) -> None:
        """Restore a checkpoint's state. The learning rate of the config wins over the saved one (a resume
        may lower it: checkpoint.RESUME_FREE); the schedule keeps its place."""
        lrs = list(self.scheduler.base_lrs)
        sharding.load_full(self.optimizer, st["drafter"], st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self._continue_clock(st.get("schedule"), self.scheduler.last_epoch)
        self.scheduler.base_lrs = lrs
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group, lr in zip(self.optimizer.param_groups, lrs):  # the same product LambdaLR takes
            group["initial_lr"], group["lr"] = lr, lr * factor
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        torch.set_rng_state(st["rng"])
        totals = dict(st["totals"])
        totals.setdefault("last_finite_step", totals["steps"])  # saved before it was kept: after a finite step
        self.totals = Totals(**totals)
        self.history = History(**st["history"])

    def _continue_clock(self, saved: dict | None, step: int) -> None:
        """The schedules continue where the checkpoint left them, over this process's total of steps."""
        total = self.clock.total
        if saved is None:  # a checkpoint from before the clock was saved: its horizon is not known
            log.warning("resume at step %d: the checkpoint does not record its schedule; the learning rate's "
                        "and Domino's lambda's schedules are planned anew over %d steps", step, total)
            return
        old = ScheduleClock(**saved)
        self.clock = old.resumed(step, total)
        if self.clock != old:
            log.warning("resume at step %d on another layout: %d optimizer steps in all where the checkpoint's "
                        "run had %d; the learning rate's and Domino's lambda's schedules continue from the "
                        "checkpoint's place (position %.2f of %d) and end at step %d: the rest is re-planned "
                        "over the %d steps left", step, total, old.total, self.clock.position(step),
                        self.clock.horizon, total, total - step)

    def optimizer_step(self, params, cfg: Config, loss_sum: float) -> float:
        """Clip and step (`training.step.clip_and_step`: the non-finite skip, `Diverged`); the gradient
        norm. The run steps through `training.step.optimizer_step`, `bench.learning` through here."""
        from dflash_dist.training.step import clip_and_step
        return clip_and_step(self, params, cfg, loss_sum)

    def last_step_finite(self) -> bool:
        return self.totals.last_finite_step == self.totals.steps

    def diverged_at_end(self) -> str | None:
        """Why a run that reached its end must not be saved or exported as trained, or None: its last step
        was skipped (the final weights are those that gave a non-finite loss or gradient), or most of its
        steps were (however high train.max_nonfinite_steps is)."""
        t = self.totals
        if not self.last_step_finite():
            return (f"training diverged: the last step ({t.steps}) was skipped for a non-finite loss or gradient "
                    f"norm ({t.skipped_steps} of {t.steps} steps skipped; the last finite one was step "
                    f"{t.last_finite_step}); the final weights are the ones that produced it")
        if 2 * t.skipped_steps > t.steps:
            return (f"training diverged: {t.skipped_steps} of the run's {t.steps} steps were skipped for a non-finite "
                    "loss or gradient norm (a run that skips most of its steps has not trained)")
        return None

    def meta(self, cfg: Config, layout: Layout, epoch_counts, plan_digests, data_digest: dict | None = None) -> dict:
        """meta.json: small, read by every rank (targets too) before the run starts."""
        c = self.cursor
        return {"cursor": {"epoch": c.epoch, "batch": c.batch}, "step": self.totals.steps,
                "layout": checkpoint.layout_meta(layout, cfg.model.target.tensor_parallel), "config": to_dict(cfg), "epoch_counts": list(epoch_counts),
                "plan_digests": list(plan_digests), "data": data_digest, "time": time.time()}

    def write(self, full: dict, cfg: Config, layout: Layout, epoch_counts, plan_digests,
              data_digest: dict | None = None) -> Path | None:
        """Rank 0 writes what `full_state` gathered: only finite weights, and only after a finite step (the
        weights after a skipped step are the ones that gave a non-finite loss); None when not written."""
        if not self.last_step_finite():
            log.warning("no checkpoint at step %d: it was skipped for a non-finite loss or gradient norm (the last "
                        "finite step was %d); the checkpoints already written are kept", self.totals.steps,
                        self.totals.last_finite_step)
            return None
        bad = [k for k, v in full["drafter"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise FloatingPointError(f"refusing to write a checkpoint with non-finite weights ({', '.join(bad[:3])})")
        return checkpoint.save_checkpoint(Path(cfg.train.run_dir), self.totals.steps, full,
                                          self.meta(cfg, layout, epoch_counts, plan_digests, data_digest),
                                          keep_last=cfg.train.keep_last, good_before=self.totals.last_finite_step)


def weights_digest(state: dict) -> str:
    """Fingerprint of a (whole) drafter state dict."""
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
