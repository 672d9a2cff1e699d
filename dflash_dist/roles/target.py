"""Target role: for each batch routed to me, collate -> frozen forward -> capture -> send to its drafter.

Batches are handled in increasing b, in windows of `train.sync_every` global steps; between windows
the rank takes part in the stop agreement (stop.py), exactly where the drafters do.
With distillation labels the forward runs to the logits and the packet also carries the target's
predictions (objective.py, transport.py).
"""
from __future__ import annotations

import logging
import time

import torch

from dflash_dist.checkpoint import Cursor
from dflash_dist.data.collate import collate
from dflash_dist.models.build import compute_dtype
from dflash_dist.objective import predictions_from_hidden
from dflash_dist.plan import broadcast_plan
from dflash_dist.roles.common import RoleResult, RunSetup, plan_digest, start_step
from dflash_dist.stop import StopAgreement
from dflash_dist.transport import PacketSender, TargetLabels

log = logging.getLogger(__name__)


def capture_for_drafter(target, batch, layer_ids, objective) -> tuple[torch.Tensor, TargetLabels | None]:
    """The features of `layer_ids` and, for distillation labels, the target's predictions (which need
    the whole forward; data labels stop after the last captured layer)."""
    distill = objective.labels != "data"
    feats, final = target.capture(batch.input_ids, batch.cu_seqlens, batch.position_ids, layer_ids,
                                  final_hidden=distill)
    if not distill:
        return feats, None
    ids, values = predictions_from_hidden(final, target.lm_head, objective.labels, objective.soft_top_k)
    return feats, TargetLabels(ids, values)


def run_target(run: RunSetup) -> RoleResult:
    cfg, ctx, target, spec = run.cfg, run.ctx, run.target, run.spec
    layout, device = ctx.layout, ctx.device
    D, S = layout.num_drafters, cfg.train.sync_every
    dtype = compute_dtype(cfg.transport.dtype, device) if cfg.transport.dtype != "auto" else next(target.parameters()).dtype
    sender = PacketSender(cfg.transport.max_in_flight)
    compute_s, plan_wait_s, sent = 0.0, 0.0, 0

    def stats() -> dict:
        wait_s = sender.wait_s + plan_wait_s
        return {"packets": sent, "compute_s": compute_s, "wait_s": wait_s}

    for epoch in range(run.cursor.epoch, cfg.train.epochs):
        t0 = time.perf_counter()
        plan = broadcast_plan(None, src=0, group=ctx.ctrl_group)
        if epoch > run.cursor.epoch:  # the first plan waits for rank 0's start-up (and tau), not the pipeline
            plan_wait_s += time.perf_counter() - t0
        n, start = len(plan), start_step(run, epoch)
        steps = layout.num_steps(n)
        mine = [b for b in layout.batches_of(ctx.rank, n) if b // D >= start]
        log.info("epoch %d: %d batches (plan %s), %d routed to me%s", epoch + 1, n, plan_digest(plan), len(mine),
                 f", resuming at step {start}" if start else "")
        agree = StopAgreement(run.stop_flag, ctx.ctrl_group)
        k = 1
        for b in mine + [None]:
            # Pass every boundary before this batch's step (all of them after the last batch).
            while start + k * S < steps and (b is None or b // D >= start + k * S):
                t0 = time.perf_counter()
                stop = agree.boundary(k)
                plan_wait_s += time.perf_counter() - t0
                if stop:
                    sender.flush()
                    return RoleResult(True, Cursor(epoch, start + k * S), stats())
                k += 1
            if b is None:
                break
            t0 = time.perf_counter()
            batch = collate(run.dataset, plan.batch(b)).to(device)
            feats, labels = capture_for_drafter(target, batch, spec.target_layer_ids, cfg.objective)
            feats = feats.to(dtype)
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # honest compute time; the send waits on it anyway
            compute_s += time.perf_counter() - t0
            sender.send(layout.route(b)[1], epoch, b, batch, feats, compute_s, sender.wait_s + plan_wait_s, labels)
            sent += 1
        t0 = time.perf_counter()
        stop = agree.finish()
        plan_wait_s += time.perf_counter() - t0
        if stop and epoch + 1 < cfg.train.epochs:
            sender.flush()
            return RoleResult(True, Cursor(epoch + 1, 0), stats())
    sender.flush()
    s = stats()
    log.info("done: %d packets sent, compute %.1fs, waiting %.1fs (%.0f%%)", sent, compute_s, s["wait_s"],
             100 * s["wait_s"] / max(compute_s + s["wait_s"], 1e-9))
    return RoleResult(False, Cursor(cfg.train.epochs, 0), s)
