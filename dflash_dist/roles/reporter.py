"""Rank 0's duties: the monitor thread, the sinks (console, JSONL, wandb), tau evaluation, epoch
records, the stop record, writing checkpoints and the export (every drafter gathers what they hold; rank
0 writes), and the end-of-run summary with the balance advice. Every other rank gets the do-nothing
twin, chosen once, so the training loop has no rank-0 branches.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflash_dist.checkpoints import store as checkpoint
from dflash_dist.config import ConfigError, measures_tau, to_dict
from dflash_dist.data.dataset import preparation_skips, preparation_sources
from dflash_dist.data.digest import dataset_digest
from dflash_dist.io.files import write_json
from dflash_dist.models import attention
from dflash_dist.models.export import export_drafter, write_model_card
from dflash_dist.models.variants import variant_of
from dflash_dist.observe.balance import balance_advice, format_advice
from dflash_dist.observe.monitor import SUPERSEDED, Monitor, Progress, Sinks, set_aside_records, wait_fraction
from dflash_dist.parallel.topology import candidate_splits
from dflash_dist.plan.epochs import BatchPlan, plan_shape
from dflash_dist.plan.schedule import EpochSchedule
from dflash_dist.training.setup import RunSetup
from dflash_dist.training.state import History, Totals, TrainState
from dflash_dist.training.stats import StepStats

log = logging.getLogger(__name__)


class NullReporter:
    """What ranks other than 0 report: nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def evaluate(self, label: str, model) -> dict | None:
        return None

    def save_due(self, next_step: int) -> bool:
        return False

    def begin_training(self) -> None: ...
    def epoch_start(self, sched: EpochSchedule, plan: BatchPlan | None = None) -> None: ...
    def step(self, s: StepStats, targets: torch.Tensor, lr: float, grad_norm: float) -> None: ...
    def epoch_end(self, sched: EpochSchedule, seconds: float) -> None: ...
    def training_over(self) -> None: ...
    def stopped(self, kind: str = "stopped") -> None: ...

    def save(self, full: dict) -> Path | None:
        return None

    def export(self, model_state: dict) -> Path | None:
        return None

    def finish(self, digest: str, checkpoint: Path | None, exported: Path | None, tau_trained: dict | None,
               identical: int = 1) -> dict:
        return {}

    def history_now(self) -> History | None:
        return None


class Reporter(NullReporter):
    def __init__(self, run: RunSetup, state: TrainState, total_steps: int):
        self.run, self.state, self.total_steps = run, state, total_steps
        self.variant = variant_of(run.cfg.model.draft.variant)
        cfg, t = run.cfg, state.totals
        self.run_dir = Path(cfg.train.run_dir)
        p = self.progress = Progress(num_epochs=cfg.train.epochs, epoch_counts=list(run.epoch_counts))
        p.step, p.tokens, p.samples, p.total_done, p.skipped_steps = t.steps, t.tokens, t.samples, t.batches, t.skipped_steps
        p.resumed_done, p.resumed_tokens, p.resumed_samples = t.batches, t.tokens, t.samples
        self.sinks: Sinks | None = None
        self.monitor: Monitor | None = None
        self.last_save = time.time()
        self.predicted: dict | None = None  # the cost model's seconds per batch (cost.start_of_run)
        self.epoch_totals = Totals()  # this epoch's steps so far (in this process): its means
        self.held_taus: list[dict] = []  # a resume's tau records of its own step, until it measures them again

    def __enter__(self):
        cfg, h = self.run.cfg, self.state.history
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.held_taus = self._set_aside_redone() if self.run.resume_from is not None else []
        self.sinks = Sinks(self.run_dir, cfg.wandb, to_dict(cfg), run_id=h.wandb_id)
        h.wandb_id = self.sinks.run_id  # a resumed run continues the same wandb run
        dataset_digest(self.run.dataset)  # each checkpoint records it: hashed once, now, not in the first save
        self.monitor = Monitor(self.progress, self.sinks, cfg.monitor.interval_s, self.run.ctx.device).start()
        log.info("plan: %s batches over %d epochs = %d total; %d optimizer steps on %d drafters",
                 list(self.run.epoch_counts), cfg.train.epochs, sum(self.run.epoch_counts), self.total_steps,
                 self.run.ctx.layout.num_drafters)
        lay = self.run.ctx.layout
        self.sinks.write({"kind": "plan", "step": self.progress.step, "epoch_counts": list(self.run.epoch_counts),
                          "packing": cfg.plan.packing, "token_budget": cfg.plan.token_budget,
                          "max_seqs": cfg.plan.max_seqs, "block_size": self.run.spec.block_size,
                          "num_drafters": lay.num_drafters, "num_targets": lay.num_targets},
                         console=False, remote=False)
        from dflash_dist.forecast.cost import start_of_run  # the predicted split and throughput, before the first batch
        self.predicted = start_of_run(cfg, self.run.dataset, lay, self.run.ctx.device, sum(self.run.epoch_counts))
        return self

    def __exit__(self, *exc) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        if self.sinks is not None:
            self.sinks.close()

    def evaluate(self, label: str, model) -> dict | None:
        """tau by real draft-then-verify decoding on held-out prompts of the synthetic corpus, or on the
        `train.eval_bench` set (the drafter asks only where `evaluates` says so), at the current step:
        logged, a `tau` record in metrics.jsonl, the monitor's line and the run's history."""
        cfg = self.run.cfg
        from dflash_dist.evaluation.measure import (
            training_eval,  # train.eval_bench's set, else the synthetic held-out one
        )
        t0 = time.time()
        # Under the training's autocast on CUDA: the attention then runs the graphs warmed up for training.
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.run.ctx.device.type == "cuda" \
            else contextlib.nullcontext()
        self.progress.activity = f"rank 0 measuring tau ({label} drafter)"  # what a "waiting" line says
        try:
            with autocast:
                r = training_eval(cfg, self.run.target, model)
        finally:
            self.progress.activity = ""
        log.info("acceptance length tau (%s drafter): %.3f over %d verify steps of %d prompts (%s); speculative "
                 "output %s the target's greedy output (%.1fs)", label, r["tau"], r["num_steps"], r["num_prompts"],
                 r["prompt_set"],
                 "equals" if r["exact"] else f"DIFFERS ({r['mismatches']} prompts) from", time.time() - t0)
        out = {k: r[k] for k in ("tau", "num_prompts", "num_steps", "exact", "mismatches", "prompt_set")}
        out.update(step=self.progress.step, label=label, accepted_per_position=r["accepted_per_position"])
        self.progress.tau = out
        self.state.history.taus.append(out)
        self.sinks.write({"kind": "tau", **out}, console=False)
        return out

    def _set_aside_redone(self) -> list[dict]:
        """A resume from step s redoes what the earlier process recorded after its checkpoint: its steps
        past s, and step s's tau when the checkpoint does not hold it (a kill between the save and the
        tau; the drafter measures it again on the same weights). Those records move to
        metrics.superseded.jsonl, so that metrics.jsonl holds each step and each tau once. The tau
        records of step s come back: written again by `begin_training` if this run did not measure it."""
        s, h = self.state.totals.steps, self.state.history
        held = {t["step"] for t in h.taus} | ({0} if h.tau_untrained else set())

        def redone(rec: dict) -> bool:
            step = rec.get("step")
            return isinstance(step, int) and (step > s or (step == s and rec.get("kind") == "tau" and s not in held))
        moved = set_aside_records(self.run_dir / "metrics.jsonl", redone)
        if moved:
            log.info("resume at step %d: %d records of the earlier process after its checkpoint moved to %s "
                     "(this run records them again)", s, len(moved), SUPERSEDED)
        return [r for r in moved if r.get("kind") == "tau" and r["step"] == s]

    def begin_training(self) -> None:
        s = self.state.totals.steps
        if self.held_taus and all(t["step"] != s for t in self.state.history.taus):
            for rec in self.held_taus:  # not measured again (no tau due at s now): the earlier measurement stands
                self.sinks.write(rec, console=False)
        self.held_taus = []
        self.progress.started = time.time()  # rates and ETA count training time only

    def epoch_start(self, sched: EpochSchedule, plan: BatchPlan | None = None) -> None:
        p = self.progress
        p.epoch, p.epoch_batches, p.epoch_done = sched.epoch, sched.num_batches, sched.origin
        self.epoch_totals = Totals()
        if plan is not None:
            self.sinks.write({"kind": "epoch_plan", "step": p.step, "epoch": sched.epoch + 1, "batches": len(plan),
                              "planned": self.run.epoch_counts[sched.epoch],
                              **plan_shape(plan, self.run.dataset.lengths)}, console=False, remote=False)

    def step(self, s: StepStats, targets: torch.Tensor, lr: float, grad_norm: float) -> None:
        """Fold one step's all-reduced stats in. The monitor thread reads `progress`; each store below is
        a single attribute assignment (atomic under the GIL)."""
        t, p = self.state.totals, self.progress
        t.add(s)
        tc = targets.cpu()
        p.loss, p.acc, p.accept_len = s.loss, s.accuracy(), s.accept_sum / max(s.blocks, 1)
        p.tokens, p.samples = t.tokens, t.samples
        p.drafter_wait_s, p.drafter_compute_s = s.wait_s, s.compute_s
        p.target_compute_s, p.target_wait_s = float(tc[:, 0].sum()), float(tc[:, 1].sum())
        p.lr, p.grad_norm, p.skipped_steps = lr, grad_norm, t.skipped_steps
        p.epoch_done += s.batches
        p.total_done = t.batches
        p.step = t.steps
        p.mark()
        self.epoch_totals.add(s)
        self.epoch_totals.steps += 1
        # One JSONL line per step (the step's batches pooled over drafters): what the run report plots
        # against the batches' mean sample length; the progress lines sample only every interval.
        # Every slot with labels: DFlash's slot 0 (the given anchor) has none, DSpark's drafts.
        hits, labels = float(s.correct.sum()), float(s.valid.sum())
        self.sinks.write({"kind": "step", "step": t.steps, "epoch": p.epoch + 1,
                          "time": round(time.time() - p.started, 3), "step_batches": s.batches,
                          "step_seqs": s.seqs, "step_tokens": s.tokens, "loss": s.loss,
                          "acc": hits / labels if labels else float("nan"), "accept_len": p.accept_len,
                          "grad_norm": grad_norm, "lr": lr,
                          # the variant's own figures (its declared sums; acc and accept_len follow its drafts)
                          **self.variant.reported_figures(s),
                          # the step's place in a variant's schedule (Domino's lambda): t.steps counts it already
                          **self.variant.step_figures(self.state.progress(t.steps - 1),
                                                      self.run.cfg.variant)},
                         console=False, remote=False)

    def epoch_end(self, sched: EpochSchedule, seconds: float) -> None:
        # The epoch's means, pooled over its steps in this process (a resumed epoch: those after the resume);
        # `loss`/`acc` of the record are the last step's.
        mean = epoch_means(self.epoch_totals)
        rec = self.monitor.report(kind="epoch_end", extra={"epoch_acc": mean["acc"], "epoch_loss": mean["loss"],
                                                           "epoch_accept_len": mean["accept_len"],
                                                           "epoch_steps": mean["steps"]})
        self.state.history.epochs.append({"epoch": sched.epoch + 1, "batches": sched.num_batches,
                                          "epoch_progress": rec["epoch_progress"], "time_s": round(seconds, 2),
                                          "tail_idle_drafters": sched.idle(), **mean})

    def training_over(self) -> None:
        self.monitor.stop()  # no more progress lines during the final evaluation

    def stopped(self, kind: str = "stopped") -> None:
        self.progress.skipped_steps = self.state.totals.skipped_steps  # a divergence ends before `step`
        self.monitor.report(kind=kind)
        if kind == "diverged":
            self._after_divergence()

    def _after_divergence(self) -> None:
        """Set aside the checkpoints that led only to non-finite steps and say where to resume from."""
        t = self.state.totals
        aside, good = checkpoint.after_divergence(self.run_dir, t.last_finite_step)
        moved = (f"; the checkpoints whose weights led only to non-finite steps were moved to {aside}"
                 if aside else "")
        if good is not None:
            log.error("the newest checkpoint known to be good is %s (its weights gave a finite step); train.resume=auto "
                      "now takes it, and a lower optim.lr is allowed at that resume: train.resume=auto optim.lr=%g%s",
                      good, self.run.cfg.optim.lr / 10, moved)
        else:
            log.error("no checkpoint of this run is known to be good: start over with train.resume=none and a lower "
                      "optim.lr (e.g. optim.lr=%g)%s", self.run.cfg.optim.lr / 10, moved)

    # -- rank 0's files: checkpoints (one copy of the whole state) and the export -----------------------
    def save(self, full: dict) -> Path | None:
        run = self.run
        self.last_save = time.time()
        return self.state.write(full, run.cfg, run.ctx.layout, run.epoch_counts, run.plan_digests,
                                dataset_digest(run.dataset))

    def save_due(self, next_step: int) -> bool:
        """Periodic saves by steps and/or minutes: rank 0 decides, the step's stats carry the decision to
        every drafter (under FSDP gathering the state is a collective)."""
        t = self.run.cfg.train
        due_steps = t.checkpoint_every_steps > 0 and next_step % t.checkpoint_every_steps == 0
        due_time = t.checkpoint_every_min > 0 and time.time() - self.last_save >= 60 * t.checkpoint_every_min
        return due_steps or due_time

    def export(self, model_state: dict) -> Path | None:
        if not self.run.cfg.train.export:
            return None
        bad = [k for k, v in model_state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise FloatingPointError(f"refusing to export non-finite weights ({', '.join(bad[:3])})")
        try:
            return export_drafter(self.run.spec, model_state, self.run_dir / "export", facts=self.card_facts())
        except OSError as exc:  # a directory made read-only during the run (at start it is checked)
            raise ConfigError(f"cannot write the export to {self.run_dir / 'export'}: {exc.strerror or exc}; the "
                              "final checkpoint is saved: make the directory writable and start again with "
                              "train.resume=auto, which writes the export") from exc

    def card_facts(self, tau: dict | None = None) -> dict:
        """What the export's model card says of the run: the target, the data seen, the trained tau."""
        tc, t = self.run.cfg.model.target, self.state.totals
        return {"target": tc.path or f"built-in tiny target (model.target.seed={tc.seed})",
                "data": {"samples": t.samples, "tokens": t.tokens, "epochs": self.run.cfg.train.epochs,
                         "optimizer steps": t.steps},
                "tau": (tau or {}).get("tau"), "tau_set": (tau or {}).get("prompt_set")}

    def finish(self, digest: str, checkpoint: Path | None, exported: Path | None, tau_trained: dict | None,
               identical: int = 1) -> dict:
        """`identical`: how many drafter ranks hold weights of this digest (check_replicas: all of them)."""
        run, t, h, p = self.run, self.state.totals, self.state.history, self.progress
        lay = run.ctx.layout
        elapsed = time.time() - p.started
        last = final_window(h.epochs, p)
        dw, dc = h.drafter_wait_s + p.drafter_wait_s, h.drafter_compute_s + p.drafter_compute_s
        tw, tc = h.target_wait_s + p.target_wait_s, h.target_compute_s + p.target_compute_s
        summary = {
            "epochs": h.epochs, "steps": t.steps, "batches": t.batches, "samples": t.samples, "tokens": t.tokens,
            "time_s": round(h.train_time_s + elapsed, 2),
            "tok_per_s": (t.tokens - p.resumed_tokens) / max(elapsed, 1e-9),  # this process's rate
            # final_*: the last epoch's means (final_window says over what); the last step alone is noise
            "final_window": last["window"], "final_loss": last["loss"],
            "mean_loss": t.loss_sum / max(t.weight_sum, 1e-9),
            "acc_per_position": [round(a, 4) for a in t.accuracy()],
            "final_acc_per_position": [round(a, 4) for a in last["acc"]],
            "final_accept_len_estimate": last["accept_len"],  # teacher-forced, over anchors: not decoding tau
            "last_step_loss": p.loss,
            "skipped_nonfinite_steps": t.skipped_steps,
            "tau_untrained": h.tau_untrained, "tau_trained": tau_trained,
            "tau_during_training": list(h.taus),  # every measurement of the run, by step (before and after too)
            "planned_batches": list(run.epoch_counts),
            "plan_digests": list(run.plan_digests),  # every epoch's plan fingerprint, as each rank logs it
            "skipped": dict(run.skipped or {}), "skipped_in_preparation": preparation_skips(run.dataset),
            "prepared_sources": preparation_sources(run.dataset),  # per --input of data.prepare (mixtures)
            "plan_facts": dict(run.plan_facts or {}),  # long samples skipped or cut (plan/long_samples.py)
            "checkpoint": str(checkpoint) if checkpoint else None, "export": str(exported) if exported else None,
            "weights_digest": digest,  # every drafter's, compared over the group before this is written
            "drafter_replicas_identical": identical, "wait_targets": wait_fraction(tw, tc), "wait_drafters": wait_fraction(dw, dc),
            "target_compute_s": tc, "target_wait_s": tw, "drafter_compute_s": dc, "drafter_wait_s": dw,
            "num_targets": lay.num_targets, "num_drafters": lay.num_drafters, "mode": run.cfg.roles.mode,
            "attention_compiles": attention.backend.compile_stats(),  # late_graphs: recompiles mid-training
        }
        if not lay.colocated:
            summary["balance"] = balance_advice(tc, dc, t.batches, lay.local_world_size, lay.drafters_per_node,
                                                summary["wait_targets"], summary["wait_drafters"],
                                                predicted=self.predicted, tensor_parallel=lay.tensor_parallel,
                                                splits=candidate_splits(lay.local_world_size, lay.tensor_parallel))
            log.info("%s", format_advice(summary["balance"]))
        if exported is not None:  # the card as exported lacked the tau measured since
            write_model_card(exported, run.spec, self.card_facts(tau_trained))
        write_json(self.run_dir / "summary.json", summary)
        self.sinks.write({"kind": "summary", **summary}, console=False)
        log.info("summary: %s", ", ".join(f"epoch {e['epoch']}: {e['batches']} batches" for e in h.epochs))
        log.info("summary: %d samples, %d tokens; this process %.1fs (%.0f tok/s); %s: loss %.3f, accuracy by "
                 "position %s, expected acceptance length %.2f", t.samples, t.tokens, elapsed, summary["tok_per_s"],
                 last["window"], last["loss"], " ".join(f"{a:.2f}" for a in last["acc"]), last["accept_len"])
        log.info("summary: checkpoint %s; export %s", checkpoint, exported)
        return summary

    def history_now(self) -> History:
        """The history as a checkpoint saved now must carry it: earlier processes plus this one so far."""
        h, p = self.state.history, self.progress
        return replace(h, train_time_s=h.train_time_s + time.time() - p.started,
                       drafter_wait_s=h.drafter_wait_s + p.drafter_wait_s,
                       drafter_compute_s=h.drafter_compute_s + p.drafter_compute_s,
                       target_wait_s=h.target_wait_s + p.target_wait_s,
                       target_compute_s=h.target_compute_s + p.target_compute_s, epochs=list(h.epochs))


def evaluates(cfg) -> bool:
    """Whether rank 0 measures tau in the run (config.measures_tau: then it holds the whole target)."""
    return measures_tau(cfg)


def epoch_means(t: Totals) -> dict:
    """An epoch's loss (weighted, as the objective normalises it), accuracy per block slot k >= 1 and
    teacher-forced acceptance estimate, pooled over its steps."""
    return {"steps": t.steps, "loss": t.loss_sum / t.weight_sum if t.weight_sum else float("nan"),
            "acc": t.accuracy(), "accept_len": t.accept_sum / t.blocks if t.blocks else float("nan")}


def final_window(epochs: list[dict], p: Progress) -> dict:
    """What the summary calls final: the last epoch's means (a checkpoint of an older version lacks them:
    then the last step's figures, said so)."""
    e = epochs[-1] if epochs else {}
    if "acc" in e:
        return {"window": f"mean of epoch {e['epoch']} ({e['steps']} steps)", "loss": e["loss"], "acc": e["acc"],
                "accept_len": e["accept_len"]}
    return {"window": "last step", "loss": p.loss, "acc": list(p.acc), "accept_len": p.accept_len}


def make_reporter(run: RunSetup, state: TrainState, total_steps: int) -> NullReporter:
    return Reporter(run, state, total_steps) if run.ctx.rank == 0 else NullReporter()
