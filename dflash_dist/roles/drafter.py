"""Drafter role: recv features -> DFlash loss -> backward -> DDP step, in lockstep with the other drafters.

A global step is one batch per drafter: in epoch e, drafter j trains batch step*D + j. Tail rule, the
same on every rank because it follows from the broadcast count N: when N is not a multiple of D, the
last step has k = N mod D real batches; the D - k drafters without one run a zero-weight step (a
forward on a one-block dummy times 0) so DDP's all-reduce still meets every rank, and the real
drafters scale their loss by D/k so the averaged gradient is the mean over the k real batches. No
batch is dropped and nothing waits forever; the rule is logged per epoch.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_dist import checkpoint, export
from dflash_dist.config import loss_gamma, to_dict
from dflash_dist.data.collate import collate
from dflash_dist.data.dataset import preparation_skips
from dflash_dist.models.build import build_drafter
from dflash_dist.monitor import Monitor, Progress, Sinks
from dflash_dist.objective import (anchor_generator, argmax_block_labels, block_labels, draw_anchors, dflash_loss,
                                   soft_block_targets, target_label_width)
from dflash_dist.plan import build_plan, broadcast_plan, plan_kwargs
from dflash_dist.balance import balance_advice, format_advice
from dflash_dist.checkpoint import Cursor
from dflash_dist.roles.common import RoleResult, RunSetup, plan_digest, start_step
from dflash_dist.roles.target import capture_for_drafter
from dflash_dist.stop import StopAgreement
from dflash_dist.transport import Packet, PacketError, PendingPacket

log = logging.getLogger(__name__)


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float):
    """Linear warmup then cosine decay to min_ratio, over the exact total of optimizer steps."""
    warmup = max(1, int(round(warmup_ratio * total_steps)))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


class LocalPacket:
    """Colocated mode: this rank's own target computes the batch's features when the step needs them."""

    def __init__(self, drafter: "Drafter", plan, epoch: int, b: int):
        self.d, self.plan, self.epoch, self.b = drafter, plan, epoch, b
        self.src = drafter.run.ctx.rank

    def wait(self) -> Packet:
        d, run = self.d, self.d.run
        t0 = time.perf_counter()
        batch = collate(run.dataset, self.plan.batch(self.b)).to(d.device)
        feats, labels = capture_for_drafter(run.target, batch, run.spec.target_layer_ids, run.cfg.objective)
        d.local_target_s += time.perf_counter() - t0
        return Packet(self.epoch, self.b, batch, feats.to(d.feat_dtype), d.local_target_s, 0.0, labels)


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Drafter:
    def __init__(self, run: RunSetup):
        self.run, cfg, ctx = run, run.cfg, run.ctx
        self.device, self.layout = ctx.device, ctx.layout
        self.D = self.layout.num_drafters
        self.j = self.layout.drafter_index(ctx.rank)
        self.model = build_drafter(run.spec, run.target, cfg.model.draft.seed, self.device)
        self.ddp = DDP(self.model, process_group=ctx.drafter_group,
                       device_ids=[self.device] if self.device.type == "cuda" else None)
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                     weight_decay=o.weight_decay)
        self.total_steps = sum(self.layout.num_steps(n) for n in run.epoch_counts)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.total_steps, o.warmup_ratio, o.min_lr_ratio))
        self.gamma = loss_gamma(cfg.objective)
        self.label_width = target_label_width(cfg.objective.labels, cfg.objective.soft_top_k)
        self.feat_dim = len(run.spec.target_layer_ids) * run.spec.hidden_size
        self.feat_dtype = next(run.target.parameters()).dtype if cfg.transport.dtype == "auto" else \
            getattr(torch, cfg.transport.dtype)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" \
            else contextlib.nullcontext()
        self.wait_s = self.compute_s = 0.0
        self.local_target_s = 0.0  # colocated mode: time in this rank's own target forward
        B = cfg.objective.block_size
        self.target_counters = torch.zeros(ctx.world_size, 2, dtype=torch.float64, device=self.device)
        self.is_rank0 = ctx.rank == 0
        self._last_save = time.time()
        self.progress = Progress(num_epochs=cfg.train.epochs, epoch_counts=list(run.epoch_counts))
        self.totals = {"correct": torch.zeros(B), "valid": torch.zeros(B), "loss_sum": 0.0, "weight_sum": 0.0,
                       "accept_sum": 0.0, "blocks": 0}

    # -- one batch ------------------------------------------------------------------------------
    def _loss(self, packet, epoch: int, b: int):
        d, cfg = packet.batch_data, self.run.cfg
        gen = anchor_generator(cfg.train.seed, epoch, b)
        anchors, anchor_cu = draw_anchors(d.loss_mask, d.cu_seqlens, cfg.objective.block_size,
                                          cfg.objective.num_anchors, gen)
        anchors, anchor_cu = anchors.to(self.device), anchor_cu.to(self.device)
        with self.autocast:
            logits = self.ddp(packet.features, d.input_ids, d.cu_seqlens, d.position_ids, anchors, anchor_cu)
        labels, weights = block_labels(d.input_ids, d.loss_mask, d.cu_seqlens, anchors, anchor_cu,
                                       cfg.objective.block_size, self.gamma)
        t = packet.target
        if t is None:
            return dflash_loss(logits, labels, weights)
        if t.values is None:
            return dflash_loss(logits, argmax_block_labels(t.ids[:, 0], labels, anchors), weights)
        probs, ids, top1 = soft_block_targets(t.values, t.ids, labels, anchors)
        return dflash_loss(logits, top1, weights, soft=(probs, ids))

    def _idle_loss(self):
        """A zero-weight step for a drafter without a batch in the tail step (keeps DDP in lockstep)."""
        B = self.run.cfg.objective.block_size
        z = torch.zeros
        feats = z(B, self.feat_dim, dtype=self.feat_dtype, device=self.device)
        ids = z(B, dtype=torch.long, device=self.device)
        cu = torch.tensor([0, B], device=self.device)
        with self.autocast:
            logits = self.ddp(feats, ids, cu, torch.arange(B, device=self.device),
                              z(1, dtype=torch.long, device=self.device), torch.tensor([0, 1], device=self.device))
        return logits.float().sum() * 0.0

    # -- one epoch ------------------------------------------------------------------------------
    def run_epoch(self, epoch: int) -> Cursor | None:
        """Train the epoch from its start step; returns the cursor where a requested stop happened."""
        cfg, ctx, layout = self.run.cfg, self.run.ctx, self.layout
        t0 = time.perf_counter()
        plan = None
        if self.is_rank0:
            plan = build_plan(self.run.dataset.lengths, self.run.dataset.num_supervised, epoch=epoch, **plan_kwargs(cfg))
            if len(plan) != self.run.epoch_counts[epoch]:
                raise RuntimeError(f"epoch {epoch + 1}: plan has {len(plan)} batches, {self.run.epoch_counts[epoch]} "
                                   "were counted at start: the plan is not a pure function of (seed, epoch)")
        plan = broadcast_plan(plan, src=0, group=ctx.ctrl_group)
        self.wait_s += time.perf_counter() - t0
        n, start = len(plan), start_step(self.run, epoch)
        self.skipped = dict(plan.skipped)
        steps, idle = layout.num_steps(n), layout.tail(n)
        log.info("epoch %d: %d batches (plan %s), %d steps%s; tail: %s", epoch + 1, n, plan_digest(plan), steps,
                 f", resuming at step {start}" if start else "",
                 f"last step has {self.D - idle} of {self.D} drafters training, {idle} idle (zero-weight, loss "
                 f"scaled by {self.D}/{self.D - idle})" if idle else "none (count is a multiple of the drafters)")
        p = self.progress
        p.epoch, p.epoch_batches, p.epoch_done = epoch, n, min(n, start * self.D)

        S, M = cfg.train.sync_every, cfg.transport.max_in_flight
        agree = StopAgreement(self.run.stop_flag, ctx.ctrl_group)
        pending: deque = deque()
        nxt = start  # next step whose packet is not posted yet

        def post_until(limit: int) -> None:
            nonlocal nxt
            while nxt < min(limit, steps):
                k = (nxt - start) // S
                if k >= 1 and agree.decided(k):
                    return  # everyone stops at boundary k: nothing past it will be sent
                b = nxt * self.D + self.j
                if b < n and layout.colocated:
                    pending.append((b, LocalPacket(self, plan, epoch, b)))
                elif b < n:
                    idx = plan.batch(b)
                    n_tok = int(self.run.dataset.lengths[idx].sum())
                    pending.append((b, PendingPacket(layout.route(b)[0], epoch, b, n_tok, len(idx), self.feat_dim,
                                                     self.feat_dtype, self.device, label_width=self.label_width,
                                                     soft=cfg.objective.labels == "target_soft")))
                nxt += 1

        B = cfg.objective.block_size
        for step in range(start, steps):
            if step > start and (step - start) % S == 0 and agree.boundary((step - start) // S):
                assert not pending, "packets were posted past an agreed stop"
                return Cursor(epoch, step)
            post_until(step + M)
            real = min(self.D, n - step * self.D)
            t0 = time.perf_counter()
            stats = torch.zeros(8 + 2 * B, dtype=torch.float64)
            if step * self.D + self.j < n:
                b, pp = pending.popleft()
                local_before = self.local_target_s
                packet = self._wait_packet(pp, b)
                t1 = time.perf_counter()
                self.wait_s += t1 - t0 - (self.local_target_s - local_before)
                self.target_counters[pp.src, 0] = packet.sender_compute_s
                self.target_counters[pp.src, 1] = packet.sender_wait_s
                loss, m = self._loss(packet, epoch, b)
                (loss * (self.D / real)).backward()
                stats[:6] = torch.tensor([m.loss_sum, m.weight_sum, packet.batch_data.num_tokens,
                                          packet.batch_data.num_seqs, m.accept_sum, m.num_blocks], dtype=torch.float64)
                stats[8:8 + B], stats[8 + B:] = m.correct, m.valid
            else:
                t1 = t0
                self._idle_loss().backward()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.compute_s += time.perf_counter() - t1
            stats[6], stats[7] = self.wait_s, self.compute_s
            self._reduce_stats(stats, step_batches=real)
            self._maybe_checkpoint(Cursor(epoch, step + 1) if step + 1 < steps else Cursor(epoch + 1, 0))
        # Batches routed to me that were never consumed would mean a broken route.
        assert not pending and nxt == steps, "drafter left packets of this epoch unreceived"
        if agree.finish() and epoch + 1 < cfg.train.epochs:
            return Cursor(epoch + 1, 0)
        return None

    def _wait_packet(self, pp: PendingPacket, b: int):
        try:
            return pp.wait()
        except PacketError:
            raise
        except Exception as exc:  # the backend's error says "connection closed", not who is gone
            raise RuntimeError(f"lost target rank {pp.src} while receiving batch {b}: {exc}") from exc

    def _reduce_stats(self, stats: torch.Tensor, step_batches: int) -> None:
        """Sum the step's metrics over drafters (and take the newest target counters) for rank 0."""
        g = self.run.ctx.drafter_group
        stats = stats.to(self.device)
        dist.all_reduce(stats, group=g)
        dist.all_reduce(self.target_counters, op=dist.ReduceOp.MAX, group=g)
        if not self.is_rank0:
            return
        s, B = stats.cpu(), self.run.cfg.objective.block_size
        t = self.totals
        t["loss_sum"] += float(s[0]); t["weight_sum"] += float(s[1])
        t["accept_sum"] += float(s[4]); t["blocks"] += int(s[5])
        t["correct"] += s[8:8 + B].float(); t["valid"] += s[8 + B:].float()
        tc = self.target_counters.cpu()
        p = self.progress
        # The monitor thread reads these; each is a single attribute store (atomic under the GIL).
        p.loss = float(s[0] / max(float(s[1]), 1e-9))
        p.acc = (s[9:8 + B] / s[9 + B:].clamp(min=1)).tolist()
        p.accept_len = float(s[4] / max(float(s[5]), 1))
        p.tokens += int(s[2]); p.samples += int(s[3])
        p.drafter_wait_s, p.drafter_compute_s = float(s[6]), float(s[7])
        p.target_compute_s, p.target_wait_s = float(tc[:, 0].sum()), float(tc[:, 1].sum())
        p.lr = self.sched.get_last_lr()[0]
        p.step += 1
        p.epoch_done += step_batches
        p.total_done += step_batches

    # -- state ----------------------------------------------------------------------------------
    def _state(self, cursor: Cursor) -> tuple[dict, dict]:
        p = self.progress
        state = {"drafter": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "rng": torch.get_rng_state(),
                 "progress": {"step": p.step, "tokens": p.tokens, "samples": p.samples, "total_done": p.total_done},
                 "totals": self.totals}
        meta = {"cursor": {"epoch": cursor.epoch, "step": cursor.step}, "step": p.step, "num_drafters": self.D,
                "config": to_dict(self.run.cfg), "epoch_counts": list(self.run.epoch_counts),
                "plan_digests": list(self.run.plan_digests), "time": time.time()}
        return state, meta

    def _load(self, path: Path) -> None:
        st = checkpoint.load_state(path)
        self.model.load_state_dict(st["drafter"])
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["rng"])
        p, pr = self.progress, st["progress"]
        p.step, p.tokens, p.samples, p.total_done = pr["step"], pr["tokens"], pr["samples"], pr["total_done"]
        p.resumed_done, p.resumed_tokens, p.resumed_samples = p.total_done, p.tokens, p.samples
        self.totals = st["totals"]
        log.info("resumed from %s at epoch %d step %d (optimizer step %d)", path, self.run.cursor.epoch + 1,
                 self.run.cursor.step, p.step)

    def _save(self, cursor: Cursor) -> Path:
        state, meta = self._state(cursor)
        self._last_save = time.time()
        return checkpoint.save_checkpoint(Path(self.run.cfg.train.run_dir), self.progress.step, state, meta,
                                          keep_last=self.run.cfg.train.keep_last)

    def _maybe_checkpoint(self, cursor: Cursor) -> None:
        """Periodic saves, rank 0 only (replicas are identical), so no agreement is needed."""
        t = self.run.cfg.train
        if not self.is_rank0:
            return
        due_steps = t.checkpoint_every_steps > 0 and self.progress.step % t.checkpoint_every_steps == 0
        due_time = t.checkpoint_every_min > 0 and time.time() - self._last_save >= 60 * t.checkpoint_every_min
        if due_steps or due_time:
            self._save(cursor)

    # -- the whole run --------------------------------------------------------------------------
    def train(self) -> RoleResult:
        cfg = self.run.cfg
        run_dir = Path(cfg.train.run_dir)
        if self.run.resume_from is not None:
            self._load(self.run.resume_from)
        monitor = sinks = None
        if self.is_rank0:
            run_dir.mkdir(parents=True, exist_ok=True)
            sinks = Sinks(run_dir, cfg.wandb, to_dict(cfg))
            monitor = Monitor(self.progress, sinks, cfg.monitor.interval_s, self.device).start()
            log.info("plan: %s batches over %d epochs = %d total; %d optimizer steps on %d drafters",
                     list(self.run.epoch_counts), cfg.train.epochs, sum(self.run.epoch_counts), self.total_steps, self.D)
        epochs_summary = []
        try:
            self.tau_before = self._evaluate("untrained") if self.run.resume_from is None else None
            self.progress.started = time.time()  # rates and ETA count training time only
            for epoch in range(self.run.cursor.epoch, cfg.train.epochs):
                t0 = time.time()
                stopped_at = self.run_epoch(epoch)
                if monitor is not None and (stopped_at is None or stopped_at.epoch > epoch):
                    rec = monitor.report(kind="epoch_end")
                    epochs_summary.append({"epoch": epoch + 1, "batches": self.progress.epoch_batches,
                                           "epoch_progress": rec["epoch_progress"], "time_s": round(time.time() - t0, 2),
                                           "loss": rec["loss"]})
                if stopped_at is not None:
                    return self._stop(stopped_at, monitor)
            if monitor is not None:
                monitor.stop()  # training is over: no more progress lines during the final evaluation
            digest = self._check_replicas()
            summary = self._finish(run_dir, epochs_summary, digest) if self.is_rank0 else {}
            if sinks is not None:
                sinks.write({"kind": "summary", **summary}, console=False)
            return RoleResult(False, Cursor(cfg.train.epochs, 0), summary)
        finally:
            if monitor is not None:
                monitor.stop()
            if sinks is not None:
                sinks.close()

    def _evaluate(self, label: str) -> dict | None:
        """Acceptance length tau by real draft-then-verify decoding against the target (rank 0, on
        held-out prompts of the synthetic corpus). Prepared data: use `python -m dflash_dist.evaluate`."""
        cfg = self.run.cfg
        if not self.is_rank0 or cfg.train.eval_prompts <= 0 or cfg.data.path:
            return None
        from dflash_dist.evaluate import acceptance_length, heldout_prompts
        t0 = time.time()
        r = acceptance_length(self.run.target, self.model, heldout_prompts(cfg, cfg.train.eval_prompts),
                              cfg.train.eval_new_tokens)
        log.info("acceptance length tau (%s drafter): %.3f over %d verify steps of %d held-out prompts; speculative "
                 "output %s the target's greedy output (%.1fs)", label, r["tau"], r["num_steps"], r["num_prompts"],
                 "equals" if r["exact"] else f"DIFFERS ({r['mismatches']} prompts) from", time.time() - t0)
        return {k: r[k] for k in ("tau", "num_prompts", "num_steps", "exact", "mismatches")}

    def _stop(self, cursor: Cursor, monitor) -> RoleResult:
        flag = self.run.stop_flag
        path = self._save(cursor) if self.is_rank0 else None
        if monitor is not None:
            monitor.report(kind="stopped")
        since = time.time() - flag.requested_at if flag.requested_at else float("nan")
        log.warning("stopped on request at epoch %d step %d (%.1fs after the signal here); %s", cursor.epoch + 1,
                    cursor.step, since, f"saved {path}" if path else "rank 0 saved the checkpoint")
        return RoleResult(True, cursor, {"checkpoint": str(path) if path else None})

    def _check_replicas(self) -> str:
        """Every drafter's weights must be bitwise equal after DDP; compare digests over the group."""
        digest = weights_digest(self.model)
        mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.D)]
        dist.all_gather(every, mine, group=self.run.ctx.drafter_group)
        log.info("final drafter weights digest %s", digest)
        if len({int(x) for x in every}) != 1:
            raise RuntimeError("drafter replicas diverged: DDP weights differ across drafter ranks")
        if self.is_rank0:
            log.info("drafter replicas identical: %d of %d", self.D, self.D)
        return digest

    def _finish(self, run_dir: Path, epochs_summary: list, digest: str) -> dict:
        cfg, t, p = self.run.cfg, self.totals, self.progress
        ckpt = self._save(Cursor(cfg.train.epochs, 0))
        exported = export.export_drafter(self.model, run_dir / "export") if cfg.train.export else None
        acc = (t["correct"][1:] / t["valid"][1:].clamp(min=1)).tolist()
        elapsed = time.time() - p.started
        summary = {
            "epochs": epochs_summary, "steps": p.step, "samples": p.samples, "tokens": p.tokens,
            "time_s": round(elapsed, 2), "tok_per_s": (p.tokens - p.resumed_tokens) / max(elapsed, 1e-9),
            "final_loss": p.loss, "mean_loss": t["loss_sum"] / max(t["weight_sum"], 1e-9),
            "acc_per_position": [round(a, 4) for a in acc], "final_acc_per_position": [round(a, 4) for a in p.acc],
            "final_accept_len_estimate": p.accept_len,  # teacher-forced, over anchors: not decoding tau
            "tau_untrained": self.tau_before, "tau_trained": self._evaluate("trained"),
            "skipped": self.skipped,
            "skipped_in_preparation": preparation_skips(self.run.dataset),
            "checkpoint": str(ckpt), "export": str(exported) if exported else None, "weights_digest": digest,
            "wait_targets": p.target_wait_s / max(p.target_wait_s + p.target_compute_s, 1e-9),
            "wait_drafters": p.drafter_wait_s / max(p.drafter_wait_s + p.drafter_compute_s, 1e-9),
            "target_compute_s": p.target_compute_s, "target_wait_s": p.target_wait_s,
            "drafter_compute_s": p.drafter_compute_s, "drafter_wait_s": p.drafter_wait_s,
            "batches": p.total_done - p.resumed_done, "num_targets": self.layout.num_targets,
            "num_drafters": self.D, "mode": cfg.roles.mode,
        }
        if not self.layout.colocated:
            summary["balance"] = balance_advice(
                p.target_compute_s, p.drafter_compute_s, summary["batches"], self.layout.local_world_size,
                self.layout.drafters_per_node, summary["wait_targets"], summary["wait_drafters"])
            log.info("%s", format_advice(summary["balance"]))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.info("summary: %s", ", ".join(f"epoch {e['epoch']}: {e['batches']} batches" for e in epochs_summary))
        log.info("summary: %d samples, %d tokens in %.1fs (%.0f tok/s); final loss %.3f; accuracy by position %s; "
                 "expected acceptance length %.2f", p.samples, p.tokens, elapsed, summary["tok_per_s"], p.loss,
                 " ".join(f"{a:.2f}" for a in p.acc), p.accept_len)
        log.info("summary: checkpoint %s; export %s", ckpt, exported)
        return summary
