"""Target role: for each batch routed to me, collate -> frozen forward -> capture -> send to its drafter.

A target replica may span `model.target.tensor_parallel` ranks (sharded by transformers or PyTorch
tensor parallelism): all of them run every batch of the replica together; its first rank sends.

Batches are handled in increasing b; before each one the rank passes the stop votes of every boundary
up to that batch's step (schedule.Votes), exactly where the drafters do. With distillation labels the
forward runs to the end and the packet also carries the target's predictions (capture.py, transport.py).
"""
from __future__ import annotations

import logging

from dflash_dist.data.collate import PackedBatch, collate, warm_up_batch
from dflash_dist.models import attention
from dflash_dist.observe.monitor import device_clock, wait_fraction
from dflash_dist.parallel.stop import StopAgreement
from dflash_dist.parallel.transport import PacketSender, packet_spec
from dflash_dist.plan.epochs import epoch_plan, plan_digest
from dflash_dist.plan.schedule import Cursor, EpochSchedule, Votes
from dflash_dist.training.capture import capture_for_drafter
from dflash_dist.training.setup import RoleResult, RunSetup

log = logging.getLogger(__name__)


class Target:
    def __init__(self, run: RunSetup):
        self.run, self.layout = run, run.ctx.layout
        self.packets = packet_spec(run.cfg, run.spec, run.ctx.device)
        self.sender = PacketSender(run.cfg.transport.max_in_flight, blocking=run.ctx.device.type == "cuda")
        self.clock = device_clock(run.ctx.device)
        self.compute_s = self.vote_wait_s = 0.0
        self.sent = 0
        self.leader = self.layout.is_replica_leader(run.ctx.rank)

    @property
    def wait_s(self) -> float:
        return self.sender.wait_s + self.vote_wait_s

    def stats(self) -> dict:
        return {"packets": self.sent, "compute_s": self.compute_s, "wait_s": self.wait_s}

    def run_all(self) -> RoleResult:
        cfg = self.run.cfg
        self.warm_up()
        for epoch in range(self.run.cursor.epoch, cfg.train.epochs):
            stopped = self.run_epoch(epoch)
            if stopped is not None:
                self.sender.flush()
                return RoleResult(True, stopped, self.stats())
        self.sender.flush()  # (not on a failure: a dead peer's sends never complete)
        log.info("done: %d packets sent, compute %.1fs, waiting %.1fs (%.0f%%); attention compiles %s",
                 self.sent, self.compute_s, self.wait_s, 100 * wait_fraction(self.wait_s, self.compute_s),
                 attention.backend.compile_stats())
        return RoleResult(False, Cursor(cfg.train.epochs, 0), self.stats())

    def run_epoch(self, epoch: int) -> Cursor | None:
        run, cfg, ctx = self.run, self.run.cfg, self.run.ctx
        t0 = self.clock()
        plan = epoch_plan(run.dataset, cfg, epoch, run.epoch_counts[epoch], ctx.rank, ctx.ctrl_group)
        if epoch > run.cursor.epoch:  # the first plan waits for rank 0's start-up (and tau), not the pipeline
            self.vote_wait_s += self.clock() - t0
        sched = EpochSchedule(epoch, len(plan), run.origin(epoch), self.layout.num_drafters, cfg.train.sync_every)
        mine = sched.target_batches(self.layout, ctx.rank)
        log.info("epoch %d: %d batches (plan %s), %d routed to me%s", epoch + 1, len(plan), plan_digest(plan),
                 len(mine), f", resuming at batch {sched.origin}" if sched.origin else "")
        votes = Votes(sched, StopAgreement(run.stop_flag, ctx.ctrl_group))
        for b in mine + [None]:
            t0 = self.clock()
            stop = votes.reach(sched.steps - 1 if b is None else sched.step_of(b))
            self.vote_wait_s += self.clock() - t0
            if stop:
                return Cursor(epoch, sched.next_batch(votes.stop_step()))
            if b is not None:
                self.compute_and_send(collate(run.dataset, plan.batch(b)), epoch, b, sched.route(self.layout, b)[1])
        t0 = self.clock()
        stop = votes.finish()
        self.vote_wait_s += self.clock() - t0
        return Cursor(epoch + 1, 0) if stop and epoch + 1 < cfg.train.epochs else None

    def compute_and_send(self, batch: PackedBatch, epoch: int, b: int, drafter: int) -> None:
        run = self.run
        t0 = self.clock()
        batch = batch.to(run.ctx.device)
        feats, labels = capture_for_drafter(run.target, batch, run.spec.target_layer_ids, run.cfg.objective,
                                            self.packets.dtype, run.spec.family.needs.final_hidden)
        self.compute_s += self.clock() - t0  # the clock waits for the GPU: this is the forward's true time
        if self.leader:  # the other ranks of a tensor-parallel replica computed the same features with it
            self.sender.send(drafter, epoch, b, batch, feats, self.compute_s, self.wait_s, labels)
            self.sent += 1

    def warm_up(self) -> None:
        """One capture of a small packed batch before the first collective (compiles the attention)."""
        dev, B, t = self.run.ctx.device, self.run.spec.block_size, self.run.target
        attention.warm_up(dev, next(t.parameters()).dtype, heads=t.num_heads, kv_heads=t.num_kv_heads,
                          head_dim=t.head_dim, ops=("causal",))
        capture_for_drafter(t, warm_up_batch(B, dev), self.run.spec.target_layer_ids, self.run.cfg.objective,
                            self.packets.dtype, self.run.spec.family.needs.final_hidden)


def run_target(run: RunSetup) -> RoleResult:
    return Target(run).run_all()
