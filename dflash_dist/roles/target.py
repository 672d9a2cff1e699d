"""Target role: for each batch routed to me, collate -> frozen forward -> capture -> send to its drafter."""
from __future__ import annotations

import logging
import time

import torch

from dflash_dist.data.collate import collate
from dflash_dist.models.build import compute_dtype
from dflash_dist.plan import broadcast_plan
from dflash_dist.roles.common import RunSetup, plan_digest
from dflash_dist.transport import PacketSender

log = logging.getLogger(__name__)


def run_target(run: RunSetup) -> dict:
    cfg, ctx, target, spec = run.cfg, run.ctx, run.target, run.spec
    layout, device = ctx.layout, ctx.device
    dtype = compute_dtype(cfg.transport.dtype, device) if cfg.transport.dtype != "auto" else next(target.parameters()).dtype
    sender = PacketSender(cfg.transport.max_in_flight)
    compute_s, plan_wait_s, sent = 0.0, 0.0, 0
    for epoch in range(cfg.train.epochs):
        t0 = time.perf_counter()
        plan = broadcast_plan(None, src=0, group=ctx.ctrl_group)
        plan_wait_s += time.perf_counter() - t0
        mine = layout.batches_of(ctx.rank, len(plan))
        log.info("epoch %d: %d batches (plan %s), %d routed to me", epoch + 1, len(plan), plan_digest(plan), len(mine))
        for b in mine:
            t0 = time.perf_counter()
            batch = collate(run.dataset, plan.batch(b)).to(device)
            feats, _ = target.capture(batch.input_ids, batch.cu_seqlens, batch.position_ids, spec.target_layer_ids)
            feats = feats.to(dtype)
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # honest compute time; the send waits on it anyway
            compute_s += time.perf_counter() - t0
            sender.send(layout.route(b)[1], epoch, b, batch, feats, compute_s, sender.wait_s + plan_wait_s)
            sent += 1
    sender.flush()
    wait_s = sender.wait_s + plan_wait_s
    log.info("done: %d packets sent, compute %.1fs, waiting %.1fs (%.0f%%)", sent, compute_s, wait_s,
             100 * wait_s / max(compute_s + wait_s, 1e-9))
    return {"packets": sent, "compute_s": compute_s, "wait_s": wait_s}
