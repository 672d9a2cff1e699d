"""Drafter role: the epoch loop, the inbox of feature packets, and the run's start and end.

Drafters train in lockstep: a global step is one batch per drafter (plan/schedule.py). What one optimizer
step does with its batch (the gradients, their reduction over the drafters, the normalisation, clip and
step) is training/step.py's, in the order `train_step` calls it; replicas (torch DDP) stay bitwise equal,
checked at the end. Rank 0's other duties (monitor, wandb, evaluation, checkpoints, export, summary) live
in roles/reporter.py; every other rank gets the do-nothing twin.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dflash_dist.checkpoints import store as checkpoint
from dflash_dist.data.collate import collate, warm_up_batch
from dflash_dist.models import attention
from dflash_dist.models.build import build_drafter
from dflash_dist.models.variants import RunProgress
from dflash_dist.observe.monitor import device_clock
from dflash_dist.parallel.sharding import make_sharding
from dflash_dist.parallel.stop import StopAgreement
from dflash_dist.parallel.transport import Packet, PacketError, PendingPacket, RecvPool, packet_spec
from dflash_dist.plan.epochs import BatchPlan, epoch_plan, plan_digest
from dflash_dist.plan.schedule import Cursor, EpochSchedule, Votes
from dflash_dist.roles.reporter import evaluates, make_reporter
from dflash_dist.training.capture import capture_for_drafter
from dflash_dist.training.objective import anchor_generator, draw_anchors
from dflash_dist.training.setup import RoleResult, RunSetup
from dflash_dist.training.state import TrainState, weights_digest
from dflash_dist.training.stats import Diverged, StepStats
from dflash_dist.training.step import (
    StepBatch,
    drafter_autocast,
    drafter_step,
    optimizer_step,
    reduce_stats,
    step_gradients,
    step_settings,
)

log = logging.getLogger(__name__)


@dataclass
class LocalTarget:
    """Colocated mode: this rank's own target, which computes a batch's features when the step needs
    them; `compute_s` sums the time it took (the drafter's wait excludes it)."""
    target: Any
    dataset: Any
    layer_ids: tuple[int, ...]
    objective: Any
    dtype: torch.dtype
    device: torch.device
    clock: Callable[[], float]
    final_features: bool = False  # the variant's `needs.final_hidden` (DSpark's teacher)
    compute_s: float = 0.0

    def packet(self, batch_ids, epoch: int, b: int) -> Packet:
        t0 = self.clock()
        batch = collate(self.dataset, batch_ids).to(self.device)
        feats, labels = capture_for_drafter(self.target, batch, self.layer_ids, self.objective, self.dtype,
                                            self.final_features)
        self.compute_s += self.clock() - t0
        return Packet(epoch, b, batch, feats, self.compute_s, 0.0, labels)


class LocalPacket:
    """A colocated batch, computed by `LocalTarget` when the step waits for it."""

    def __init__(self, local: LocalTarget, batch_ids, epoch: int, b: int):
        self.local, self.batch_ids, self.epoch, self.b = local, batch_ids, epoch, b

    def wait(self) -> Packet:
        return self.local.packet(self.batch_ids, self.epoch, self.b)


@dataclass(frozen=True)
class Receiver:
    """What an Inbox needs of its drafter: where its batches come from and what they look like."""
    layout: Any
    index: int  # this drafter's index among the drafters
    packets: Any  # training.capture's PacketSpec
    lengths: Any  # the dataset's sample lengths (a packet's size follows from its batch)
    device: torch.device
    pool: RecvPool | None  # CPU receive buffers, reused
    local: LocalTarget | None  # colocated mode's own target


class Inbox:
    """This drafter's packets of one epoch, requested up to `transport.max_in_flight` steps ahead, in
    increasing batch order (the order its targets send them in)."""

    def __init__(self, rx: Receiver, plan: BatchPlan, sched: EpochSchedule, votes: Votes):
        self.rx, self.plan, self.sched, self.votes = rx, plan, sched, votes
        self.pending: deque = deque()
        self.next_step = 0  # first step whose packet is not requested yet

    def post_until(self, limit: int) -> None:
        sched = self.sched
        while self.next_step < min(limit, sched.steps):
            if self.votes.stops_by(self.next_step):
                return  # everyone stops at that boundary: nothing past it will be sent
            b = sched.batch(self.next_step, self.rx.index)
            if b is not None:
                self.pending.append((b, self._request(b)))
            self.next_step += 1

    def _request(self, b: int):
        rx, spec = self.rx, self.rx.packets
        if rx.local is not None:
            return LocalPacket(rx.local, self.plan.batch(b), self.sched.epoch, b)
        n_tok, n_seq = spec.shape(rx.lengths, self.plan.batch(b))
        return PendingPacket(self.sched.route(rx.layout, b)[0], self.sched.epoch, b, n_tok, n_seq, spec.feat_dim,
                             spec.dtype, rx.device, label_width=spec.label_width, soft=spec.soft, pool=rx.pool)

    def take(self, b: int) -> Packet:
        got, pp = self.pending.popleft()
        assert got == b, f"drafter expected batch {b}, the next requested is {got}"
        try:
            return pp.wait()
        except PacketError:
            raise
        except Exception as exc:  # the backend's error says "connection closed", not who is gone
            raise RuntimeError(f"lost target rank {pp.src} while receiving batch {b}: {exc}") from exc

    def done(self, packet: Packet) -> None:
        """The step that used `packet` is over: its feature buffer may be received into again."""
        if self.rx.pool is not None and self.rx.local is None:
            self.rx.pool.give_back(packet.features)

    def check_empty(self) -> None:
        # Packets requested past an agreed stop, or batches never consumed, would mean a broken route.
        assert not self.pending, "drafter holds requested packets past the end of its part of the epoch"


class Drafter:
    def __init__(self, run: RunSetup):
        self.run, cfg, ctx = run, run.cfg, run.ctx
        self.layout, self.device = ctx.layout, ctx.device
        self.D, self.j = self.layout.num_drafters, self.layout.drafter_index(ctx.rank)
        model = build_drafter(run.spec, run.target, cfg.model.draft.seed, self.device,
                              checkpoint_layers=cfg.model.draft.checkpoint_layers)
        # Drafter 0's weights to every DDP replica, or FSDP2 shards: before the optimizer sees the parameters.
        self.sharding = make_sharding(cfg.roles.drafter_sharding, model, ctx.drafter_group, self.device)
        self.total_steps = self._total_steps()
        self.state = TrainState.create(model, cfg, self.total_steps)
        if run.resume_from is not None:
            self.state.load(checkpoint.load_state(run.resume_from), self.sharding)
            log.info("resumed from %s at epoch %d batch %d (optimizer step %d of %d)", run.resume_from,
                     run.cursor.epoch + 1, run.cursor.batch, self.state.totals.steps, self.total_steps)
        self.state.cursor = run.cursor
        self.packets = packet_spec(cfg, run.spec, self.device)
        pool = RecvPool() if self.device.type == "cpu" else None  # CUDA: the caching allocator is one
        self.settings = step_settings(cfg, run.spec, drafter_autocast(self.device))
        self.clock = device_clock(self.device)
        self.wait_s = self.compute_s = 0.0
        local = LocalTarget(run.target, run.dataset, tuple(run.spec.target_layer_ids), cfg.objective,
                            self.packets.dtype, self.device, self.clock, run.spec.family.needs.final_hidden) \
            if self.layout.colocated else None
        self.rx = Receiver(self.layout, self.j, self.packets, run.dataset.lengths, self.device, pool, local)
        self.target_counters = torch.zeros(ctx.world_size, 2, dtype=torch.float64, device=self.device)
        self.reporter = make_reporter(run, self.state, self.total_steps)
        self.save_due = False
        self.warm_up()  # compiles before the training's collectives, so no timeout counts a compile

    def _total_steps(self) -> int:
        """Optimizer steps of the whole run: those already taken (a resume) plus those left on this layout."""
        run = self.run
        done = checkpoint.read_meta(run.resume_from)["step"] if run.resume_from is not None else 0
        left = sum(-(-(n - run.origin(e)) // self.D) for e, n in enumerate(run.epoch_counts) if e >= run.cursor.epoch)
        return done + left

    # -- the whole run ---------------------------------------------------------------------------
    def train(self) -> RoleResult:
        state, epochs = self.state, self.run.cfg.train.epochs
        with self.reporter:
            if self.run.resume_from is None:
                state.history.tau_untrained = self.evaluate("untrained")
            elif self.eval_due() and all(t["step"] != state.totals.steps for t in state.history.taus):
                # The checkpoint is saved before its step's tau is measured: a kill between the two leaves
                # the tau in metrics.jsonl only. Measured again on the same weights, so the summary has it
                # too (the report keeps the later of a step's two records). Every drafter decides alike.
                self.evaluate(f"step {state.totals.steps}")
            self.reporter.begin_training()
            for epoch in range(state.cursor.epoch, epochs):
                try:
                    stopped = self.run_epoch(epoch)
                    if stopped is None and epoch + 1 == epochs and (why := state.diverged_at_end()):
                        raise Diverged(why)  # nothing of such a run is saved or exported as trained
                except Diverged:
                    self.reporter.stopped(kind="diverged")  # the last record shows the skipped steps
                    raise
                if stopped is not None:
                    return self.stop(stopped)
            self.reporter.training_over()
            return self.finish()

    def run_epoch(self, epoch: int) -> Cursor | None:
        """Train the epoch from this run's origin; returns the cursor where an agreed stop happened."""
        run, cfg = self.run, self.run.cfg
        t0, tw = time.time(), self.clock()
        plan = epoch_plan(run.dataset, cfg, epoch, run.epoch_counts[epoch], run.ctx.rank, run.ctx.ctrl_group)
        self.wait_s += self.clock() - tw
        sched = EpochSchedule(epoch, len(plan), run.origin(epoch), self.D, cfg.train.sync_every)
        self._log_epoch(sched, plan)
        self.reporter.epoch_start(sched, plan)
        votes = Votes(sched, StopAgreement(run.stop_flag, run.ctx.ctrl_group))
        inbox = Inbox(self.rx, plan, sched, votes)
        for step in range(sched.steps):
            if votes.reach(step):
                inbox.check_empty()
                return Cursor(epoch, sched.next_batch(step))
            inbox.post_until(step + cfg.transport.max_in_flight)
            self.train_step(sched, step, inbox)
            done = step + 1 == sched.steps
            self.state.cursor = Cursor(epoch + 1, 0) if done else Cursor(epoch, sched.next_batch(step + 1))
            if self.save_due:
                self.save()
            if self.eval_due():
                self.evaluate(f"step {self.state.totals.steps}")
        inbox.check_empty()
        self.reporter.epoch_end(sched, time.time() - t0)
        if votes.finish() and epoch + 1 < cfg.train.epochs:
            return Cursor(epoch + 1, 0)
        return None

    def _log_epoch(self, sched: EpochSchedule, plan: BatchPlan) -> None:
        idle = sched.idle()
        tail = (f"last step has {self.D - idle} of {self.D} drafters training, {idle} idle (a zero-weight step: "
                "they join the gradient reduction)" if idle else "none (the batches left are a multiple of the drafters)")
        log.info("epoch %d: %d batches (plan %s), %d steps%s; tail: %s", sched.epoch + 1, sched.num_batches,
                 plan_digest(plan), sched.steps, f", resuming at batch {sched.origin}" if sched.origin else "", tail)

    def local_target_s(self) -> float:
        """Seconds this rank's own target spent on its batches (colocated mode; else 0)."""
        return self.rx.local.compute_s if self.rx.local is not None else 0.0

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self, sched: EpochSchedule, step: int, inbox: Inbox) -> None:
        """Receive (or idle in a tail step), then one optimizer step (training/step.py): this drafter's
        gradients, the stats' reduction, normalise, clip and step."""
        stats = StepStats(self.settings.block_size, figures=self.run.spec.family.figures)
        b, batch = sched.batch(step, self.j), None
        t0, local0 = self.clock(), self.local_target_s()
        t1 = t0
        if b is not None:
            packet = inbox.take(b)
            t1 = self.clock()
            self.wait_s += t1 - t0 - (self.local_target_s() - local0)
            self.target_counters[packet_src(inbox, packet, self.run.ctx.rank)] = torch.tensor(
                [packet.sender_compute_s, packet.sender_wait_s], dtype=torch.float64)
            batch = self.step_batch(packet, sched.epoch, b)
        m = step_gradients(self.sharding, batch, self.settings, self.idle_batch)
        if m is not None:
            stats.take_metrics(m)  # device tensors stay on the device: packed there
            stats.tokens, stats.seqs, stats.batches = batch.data.num_tokens, batch.data.num_seqs, 1
            inbox.done(packet)
        stats.wait_s, stats.compute_s = self.wait_s, self.compute_s + self.clock() - t1
        stats.save_due = int(self.reporter.save_due(self.state.totals.steps + 1))
        g = self.run.ctx.drafter_group
        total = reduce_stats(stats, g, self.device)
        dist.all_reduce(self.target_counters, op=dist.ReduceOp.MAX, group=g)  # the newest target counters
        self.save_due = total.save_due > 0
        norm = optimizer_step(self.state, self.sharding, self.settings, total, sched.real(step), self.run.cfg)
        self.compute_s += self.clock() - t1
        self.reporter.step(total, self.target_counters, self.state.scheduler.get_last_lr()[0], norm)

    def step_batch(self, packet: Packet, epoch: int, b: int) -> StepBatch:
        """Anchors are drawn on the host from the packet's meta (on CUDA that read waits for the packet,
        which the step needs first anyway: one synchronisation at the step's start)."""
        o, d = self.run.cfg.objective, packet.batch_data
        anchors, anchor_cu = draw_anchors(d.loss_mask, d.cu_seqlens, o.num_anchors,
                                          anchor_generator(self.run.cfg.train.seed, epoch, b))
        return StepBatch(d, packet.features, packet.target, anchors, anchor_cu, self.progress())

    def progress(self) -> RunProgress:
        """The coming step's place in the run: steps taken (restored on resume) of the exact total."""
        return self.state.progress(self.state.totals.steps)

    # -- start and end ----------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile the attention paths and run one step on a small batch before training; its gradients
        are dropped: nothing of it reaches the weights, the optimizer or any RNG that training uses."""
        B, dev, spec = self.settings.block_size, self.device, self.run.spec
        attention.warm_up(dev, torch.float32, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, block_size=B, ops=("block",),
                          autocast_dtype=torch.bfloat16 if dev.type == "cuda" else None)
        t0 = time.perf_counter()
        self.sharding.begin_step()
        drafter_step(self.state.model, self.idle_batch(), replace(self.settings, anchor_chunk=1),
                     sharding=self.sharding)
        self.state.optimizer.zero_grad(set_to_none=not self.sharding.keep_grads)
        log.info("warm-up step done in %.1fs", time.perf_counter() - t0)

    def idle_batch(self) -> StepBatch:
        """A small fixed packed batch: the warm-up's, and a tail step's idle drafter's zero-weight step."""
        batch = warm_up_batch(self.settings.block_size, self.device)
        anchors, anchor_cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, 2, torch.Generator().manual_seed(0))
        feats = torch.zeros(batch.num_tokens, self.packets.feat_dim, dtype=self.packets.dtype, device=self.device)
        return StepBatch(batch, feats, None, anchors, anchor_cu, self.progress())

    def save(self) -> Path | None:
        """Every drafter gathers (a collective under FSDP); rank 0 writes."""
        full = self.state.full_state(self.sharding, self.reporter.history_now())
        return self.reporter.save(full)

    def eval_due(self) -> bool:
        """tau every train.eval_every_steps optimizer steps: the same decision on every drafter (their step
        counts are equal; under FSDP all gather the weights), not at the last step (the end measures it)."""
        n, steps = self.run.cfg.train.eval_every_steps, self.state.totals.steps
        return n > 0 and steps % n == 0 and steps < self.total_steps and evaluates(self.run.cfg)

    def evaluate(self, label: str) -> dict | None:
        """tau on rank 0, with the whole drafter (under FSDP a plain copy of the gathered weights)."""
        if not evaluates(self.run.cfg):
            return None
        model = self.state.model
        if self.sharding.kind == "fsdp":
            model = build_drafter(self.run.spec, self.run.target, 0, self.device)
            model.load_state_dict(self.sharding.full_model_state())
        return self.reporter.evaluate(label, model)

    def stop(self, cursor: Cursor) -> RoleResult:
        self.state.cursor = cursor
        path = self.save()
        self.reporter.stopped()
        log.warning("stopped on request at epoch %d batch %d (%s); %s", cursor.epoch + 1, cursor.batch,
                    self.run.stop_flag.describe(), f"saved {path}" if path else "rank 0 saves the checkpoint"
                    if self.run.ctx.rank else "no checkpoint: the last step was skipped, see above")
        return RoleResult(True, cursor, {"checkpoint": str(path) if path else None})

    def finish(self) -> RoleResult:
        weights = self.sharding.full_model_state()
        digest = self.check_replicas(weights)
        ckpt, exported = self.save(), self.reporter.export(weights)
        summary = self.reporter.finish(digest, ckpt, exported, self.evaluate("trained"), identical=self.D)
        return RoleResult(False, Cursor(self.run.cfg.train.epochs, 0), summary)

    def check_replicas(self, weights: dict) -> str:
        """Every drafter's (whole) weights must be bitwise equal; compare digests over the group."""
        digest = weights_digest(weights)
        mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.D)]
        dist.all_gather(every, mine, group=self.run.ctx.drafter_group)
        log.info("final drafter weights digest %s", digest)
        if len({int(x) for x in every}) != 1:
            raise RuntimeError("drafter replicas diverged: weights differ across drafter ranks")
        log.info("drafter replicas identical: %d of %d", self.D, self.D)
        return digest


def packet_src(inbox: Inbox, packet: Packet, rank: int) -> int:
    """The rank whose counters a packet carries (this rank itself in colocated mode)."""
    return rank if inbox.rx.local is not None else inbox.sched.route(inbox.rx.layout, packet.batch)[0]
