"""The report's figures, one function each: runs in, a `Drawn` out (a matplotlib Figure, or a note saying
why the figure is left out). Several runs share the axes, one colour per run."""
from __future__ import annotations

import numpy as np

from dflash_dist.report.plotting import (
    Drawn,
    color,
    mark_epochs,
    max_time,
    missing,
    new_figure,
    no_data,
    pearson,
    smooth,
    time_unit,
    values,
)
from dflash_dist.report.runs import RunData

DETREND = 9  # steps in the moving mean taken out of per-step accuracy (the learning trend)
SNAPSHOTS = ("progress", "epoch_end", "stopped", "diverged")  # records that carry the monitor's snapshot


def snapshots(run: RunData) -> list[dict]:
    return [r for r in run.records if r.get("kind", "progress") in SNAPSHOTS and "_t" in r]


def _curves(run: RunData) -> tuple[list[dict], bool]:
    """Per-step records, or for a run written before they existed, its progress snapshots."""
    steps = run.steps()
    return (steps, True) if steps else (run.kind("progress"), False)


def loss_accuracy(runs: list[RunData]) -> Drawn:
    name, title = "loss_accuracy", "Loss, accuracy and expected acceptance length over optimizer steps"
    caption = ("Thin lines: every optimizer step (its batches pooled over the drafters); thick lines: a centred "
               "moving mean. Dotted verticals: epoch ends. Accuracy: share of drafted tokens equal to their label "
               "over all block positions k >= 1 (teacher-forced). Expected acceptance length: the estimate from "
               "per-position accuracy, not tau measured by decoding. A wide band of thin lines around the mean is "
               "step-to-step variation; batches of different make-up (e.g. length-sorted ones) widen it.")
    if not any(_curves(r)[0] for r in runs):
        return no_data(name, title, caption, "no run has step or progress records yet")
    fig, axes = new_figure(3, 1, height=2.7, sharex=True)
    keys = (("loss", "loss (weighted cross-entropy, nats)"), ("acc", "accuracy (all positions)"),
            ("accept_len", "expected acceptance length (tokens)"))
    for i, run in enumerate(runs):
        recs, per_step = _curves(run)
        x = values(recs, "step")
        for ax, (key, _) in zip(axes[:, 0], keys):
            y = values(recs, key) if key != "acc" or per_step else np.array(
                [np.mean(r["acc"]) if r.get("acc") else np.nan for r in recs])
            mean, w = smooth(y)
            if w > 1:
                ax.plot(x, y, color=color(i), linewidth=0.6, alpha=0.3)
            ax.plot(x, mean, color=color(i), linewidth=1.8,
                    label=f"{run.label} (mean of {w} steps)" if w > 1 else run.label)
    for k, (ax, (_, label)) in enumerate(zip(axes[:, 0], keys)):
        mark_epochs(ax, runs, with_label=k == 0)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(title)
    axes[0, 0].legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("optimizer step")
    notes = missing(runs, lambda r: bool(r.steps()), "per-step records (progress snapshots drawn instead)")
    return Drawn(name, title, caption, fig, run_notes=notes)


def accuracy_by_position(runs: list[RunData]) -> Drawn:
    name, title = "accuracy_by_position", "Accuracy at each block position, first and last epoch"
    caption = ("Share of drafted tokens equal to their label at block position k (k = 1 is the token after the "
               "anchor), pooled over each epoch's steps. tau grows with the product of these: a drafter is "
               "accepted up to its first miss.")
    have = [r for r in runs if any(e.get("epoch_acc") for e in r.epoch_ends().values())]
    if not have:
        return no_data(name, title, caption, "no run has finished an epoch yet (epoch_end records with epoch_acc)")
    fig, axes = new_figure(1, 1, width=9.0, height=4.2)
    ax = axes[0, 0]
    for i, run in enumerate(runs):
        ends = {e: r["epoch_acc"] for e, r in sorted(run.epoch_ends().items()) if r.get("epoch_acc")}
        if not ends:
            continue
        first, last = min(ends), max(ends)
        for e, style in ((first, "--"), (last, "-")) if first != last else ((last, "-"),):
            acc = ends[e]
            ax.plot(range(1, len(acc) + 1), acc, style, marker="o", markersize=3, color=color(i),
                    label=f"{run.label}, epoch {e}")
    ax.set(title=title, xlabel="block position k", ylabel="accuracy at position k", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return Drawn(name, title, caption, fig, run_notes=missing(runs, lambda r: r in have, "epoch accuracy records"))


def _rates(recs: list[dict]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Per interval between snapshots: mid time, tokens/s, and each role's wait fraction. Intervals across
    a process restart (counters that went back) are NaN. Runs without the cumulative seconds give the
    fractions since the start instead."""
    t = values(recs, "_t")
    gaps = np.diff(t)
    if len(gaps) and (gaps > 0).any():
        # An epoch end or a stop reports right after a tick: an interval that short would give a rate of
        # one batch over milliseconds, so such a record is merged into the next interval.
        min_dt, kept, last = 0.5 * float(np.median(gaps[gaps > 0])), [0], t[0]
        for i in range(1, len(recs)):
            if t[i] - last >= min_dt:  # `_t` runs on across processes (runs.py): it never goes back
                kept.append(i)
                last = t[i]
        recs, t = [recs[i] for i in kept], t[kept]
    tok = values(recs, "tokens")
    dt, dtok = np.diff(t), np.diff(tok)
    ok = (dt > 1e-3) & (dtok >= 0)
    rate = np.where(ok, dtok / np.where(ok, dt, 1.0), np.nan)
    waits = {}
    for role in ("targets", "drafters"):
        w, c = values(recs, f"{role[:-1]}_wait_s"), values(recs, f"{role[:-1]}_compute_s")
        if np.isfinite(w).any():
            dw, dc = np.diff(w), np.diff(c)
            good = (dw >= 0) & (dc >= 0) & (dw + dc > 0)
            waits[role] = np.where(good, dw / np.where(good, dw + dc, 1.0), np.nan)
        else:
            waits[role] = values(recs, f"wait_{role}")[1:]
    return (t[1:] + t[:-1]) / 2, rate, waits


def throughput_wait(runs: list[RunData]) -> Drawn:
    name, title = "throughput_wait", "Throughput and waiting: which side is the bottleneck"
    caption = ("Top: tokens trained per second between the monitor's reports (moving mean). Bottom: share of "
               "each role's time spent waiting in the same intervals: targets waiting means the drafters are "
               "the bottleneck (add drafters); drafters waiting means the targets are (add targets).")
    have = [r for r in runs if len(snapshots(r)) >= 2]
    if not have:
        return no_data(name, title, caption, "no run has two progress reports yet (monitor.interval_s apart)")
    scale, unit = time_unit(max_time(have))
    fig, axes = new_figure(2, 1, height=3.0, sharex=True)
    for i, run in enumerate(runs):
        if run not in have:
            continue
        mid, rate, waits = _rates(snapshots(run))
        axes[0, 0].plot(mid / scale, smooth(rate)[0], color=color(i), linewidth=1.6, label=run.label)
        for role, style in (("targets", "-"), ("drafters", "--")):
            axes[1, 0].plot(mid / scale, 100 * smooth(waits[role])[0], style, color=color(i), linewidth=1.4,
                            label=f"{run.label}: {role} waiting")
    axes[0, 0].set(title=title, ylabel="throughput (tokens/s)", ylim=(0, None))
    axes[1, 0].set(xlabel=f"training time ({unit})", ylabel="time spent waiting (%)", ylim=(0, 100))
    for ax in axes[:, 0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    return Drawn(name, title, caption, fig, run_notes=missing(runs, lambda r: r in have, "progress reports"))


def _epoch_table(run: RunData) -> dict[int, dict]:
    """epoch -> planned batches (counted at start), batches trained (from the step records), batch shape."""
    counts = run.plan().get("epoch_counts") or (run.summary or {}).get("planned_batches") or []
    table = {e + 1: {"planned": n} for e, n in enumerate(counts)}
    for e, r in run.epoch_plans().items():
        table.setdefault(e, {}).update({k: v for k, v in r.items() if k.startswith(("samples_", "tokens_"))},
                                       planned=r.get("planned", r.get("batches")))
    for s in run.steps():
        row = table.setdefault(s["epoch"], {})
        row["run"] = row.get("run", 0) + s.get("step_batches", 0)
    if not run.steps():  # older runs: the epoch-end snapshot's batch counter
        for e, r in run.epoch_ends().items():
            table.setdefault(e, {})["run"] = r.get("batch")
    return dict(sorted(table.items()))


def batches_per_epoch(runs: list[RunData]) -> Drawn:
    name, title = "batches_per_epoch", "Batches per epoch, and samples and tokens per batch"
    caption = ("Left: batches of each epoch as counted when the run started (bars) and as trained (crosses); "
               "they differ only for an epoch the run has not finished. plan.packing=fill repacks every epoch, "
               "so its count changes; plan.packing=sorted keeps the same batches. Middle and right: samples and "
               "real tokens per batch of each epoch's plan, mean with the range min..max.")
    tables = {run.label: _epoch_table(run) for run in runs}
    if not any(tables.values()):
        return no_data(name, title, caption, "no run has a plan record (its counts at start) yet")
    fig, axes = new_figure(1, 3, width=13.0, height=4.2)
    n, width = len(runs), 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        tab = tables[run.label]
        ep = np.array(list(tab), dtype=float)
        x = ep + (i - (n - 1) / 2) * width
        planned = [tab[e].get("planned", np.nan) for e in tab]
        bars = axes[0, 0].bar(x, planned, width=width * 0.9, color=color(i), alpha=0.6,
                              label=f"{run.label}: planned")
        axes[0, 0].bar_label(bars, fontsize="small", label_type="center")
        axes[0, 0].plot(x, [tab[e].get("run", np.nan) for e in tab], "x", color="black", markersize=8,
                        label="trained" if i == 0 else None)
        for ax, key in ((axes[0, 1], "samples"), (axes[0, 2], "tokens")):
            mean, lo, hi = (np.array([tab[e].get(f"{key}_{s}", np.nan) for e in tab], dtype=float)
                            for s in ("mean", "min", "max"))
            ax.errorbar(x, mean, yerr=[mean - lo, hi - mean], fmt="o", color=color(i), capsize=4, label=run.label)
    axes[0, 0].set(title="batches per epoch", xlabel="epoch", ylabel="batches")
    axes[0, 1].set(title="samples per batch", xlabel="epoch", ylabel="samples (mean, min..max)")
    axes[0, 2].set(title="real tokens per batch", xlabel="epoch", ylabel="tokens (mean, min..max)")
    epochs = sorted({e for t in tables.values() for e in t})
    for ax in axes[0]:
        ax.set_xticks(epochs)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.suptitle(title)
    notes = missing(runs, lambda r: bool(r.epoch_plans()), "per-epoch batch shapes (epoch_plan records)")
    return Drawn(name, title, caption, fig, run_notes=notes)


def batch_accuracy_vs_length(runs: list[RunData]) -> Drawn:
    name, title = "batch_accuracy_vs_length", "Does batch make-up drive accuracy? Per-step accuracy against mean length"
    caption = ("Each point is one optimizer step: its accuracy (all block positions) against the mean length of "
               "the samples it trained on (its real tokens / its samples). Left: the second half of each run's "
               "steps (past the steepest part of learning). Right: every step, its accuracy minus the mean of the "
               f"{DETREND} steps around it (the learning trend taken out). r: Pearson correlation. Length-sorted "
               "batches spread along the length axis; shuffled ones gather near the corpus mean.")
    have = [r for r in runs if len(r.steps()) >= 3]
    if not have:
        return no_data(name, title, caption, "no run has per-step records (step records, written since this report)")
    fig, axes = new_figure(1, 2, width=12.0, height=4.6)
    for i, run in enumerate(have):
        steps = run.steps()
        length = values(steps, "step_tokens") / np.maximum(values(steps, "step_seqs"), 1)
        acc = values(steps, "acc")
        half = slice(len(steps) // 2, None)
        detrended = acc - smooth(acc, DETREND)[0]
        for ax, x, y in ((axes[0, 0], length[half], acc[half]), (axes[0, 1], length, detrended)):
            ax.scatter(x, y, s=10, alpha=0.5, color=color(runs.index(run)), edgecolors="none",
                       label=f"{run.label} (r = {pearson(x, y):+.2f}, sd {np.nanstd(y):.3f}, "
                             f"{np.isfinite(y).sum()} steps)")
    axes[0, 0].set(title="accuracy, second half of the run", ylabel="step accuracy")
    axes[0, 1].set(title="accuracy minus its moving mean, all steps", ylabel="step accuracy - moving mean")
    axes[0, 1].axhline(0, color="grey", linewidth=0.8)
    for ax in axes[0]:
        ax.set_xlabel("mean sample length of the step's batches (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return Drawn(name, title, caption, fig, run_notes=missing(runs, lambda r: r in have, "per-step records"))


def step_accuracy_and_length(runs: list[RunData], window: int = 60) -> Drawn:
    name, title = "step_accuracy_and_length", "Step by step: accuracy and the mean length of the batch trained"
    caption = (f"The last {window} optimizer steps of each run (one panel per run). Line: the step's accuracy "
               "(all block positions); grey bars: the mean sample length of the step's batches (right axis). "
               "When accuracy rises and falls with the bars, batch make-up, not learning, moves the curve.")
    have = [r for r in runs if len(r.steps()) >= 3]
    if not have:
        return no_data(name, title, caption, "no run has per-step records (step records, written since this report)")
    fig, axes = new_figure(len(have), 1, height=2.6)
    for ax, run in zip(axes[:, 0], have):
        steps = run.steps()[-window:]
        x = values(steps, "step")
        length = values(steps, "step_tokens") / np.maximum(values(steps, "step_seqs"), 1)
        twin = ax.twinx()
        twin.bar(x, length, width=0.8, color="grey", alpha=0.35, label="mean sample length")
        twin.set(ylabel="mean sample length (tokens)", ylim=(0, 1.35 * np.nanmax(length)))  # room for the legend
        ax.set_zorder(twin.get_zorder() + 1)  # the accuracy line above the bars
        ax.patch.set_visible(False)
        acc = values(steps, "acc")
        ax.plot(x, acc, "-o", markersize=3, color=color(runs.index(run)), label="step accuracy")
        ax.set(title=f"{run.label} (r = {pearson(length, acc):+.2f})", ylabel="step accuracy",
               ylim=(0, 1.35 * np.nanmax(acc)))
        ax.grid(alpha=0.3)
        lines = ax.get_legend_handles_labels()
        bars = twin.get_legend_handles_labels()
        ax.legend(lines[0] + bars[0], lines[1] + bars[1], fontsize="small", loc="upper left", ncol=2)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(title)
    return Drawn(name, title, caption, fig, run_notes=missing(runs, lambda r: r in have, "per-step records"))


def tau(runs: list[RunData]) -> Drawn:
    name, title = "tau", "Acceptance length tau, measured by decoding and estimated in training"
    caption = ("tau measured by real draft-then-verify decoding on held-out prompts (the synthetic held-out set or "
               "train.eval_bench): before and after training (summary.json), beside the training's teacher-forced "
               "estimate over its last epoch; and, where the run measured it during training "
               "(train.eval_every_steps), tau at each of those optimizer steps (metrics.jsonl's tau records). "
               "Drawn for runs that measured it (train.eval_prompts > 0, and train.eval_bench with prepared data; "
               "else python -m dflash_dist.evaluate).")

    def measured(run: RunData, key: str) -> float:
        v = (run.summary or {}).get(key)
        return float(v["tau"]) if isinstance(v, dict) and isinstance(v.get("tau"), (int, float)) else np.nan
    ends = [r for r in runs if np.isfinite(measured(r, "tau_trained")) or np.isfinite(measured(r, "tau_untrained"))]
    curves = [r for r in runs if r.kind("tau")]
    if not ends and not curves:
        return no_data(name, title, caption, "no run measured tau (evaluation off: train.eval_prompts=0, prepared "
                       "data without train.eval_bench, or the run has not finished)")
    fig, axes = new_figure(2 if curves else 1, 1, width=8.0, height=4.2)
    ax, kinds = axes[0, 0], ("before training", "after training", "training estimate")
    width = 0.8 / max(len(ends), 1)
    for i, run in enumerate(ends):
        est = (run.summary or {}).get("final_accept_len_estimate")
        ys = [measured(run, "tau_untrained"), measured(run, "tau_trained"),
              float(est) if isinstance(est, (int, float)) else np.nan]
        x = np.arange(3) + (i - (len(ends) - 1) / 2) * width
        bars = ax.bar(x, ys, width=width * 0.9, color=color(runs.index(run)), label=run.label)
        ax.bar_label(bars, fmt="%.2f", fontsize="small")
    ax.set_xticks(range(3), kinds)
    ax.set(title=title, ylabel="tokens accepted per verify step", ylim=(0, None))
    ax.grid(alpha=0.3, axis="y")
    if ends:
        ax.legend(fontsize="small", loc="upper left")
    if curves:
        ax = axes[1, 0]
        for run in curves:
            recs = run.taus()  # a step measured again after a resume: once
            ax.plot(values(recs, "step"), values(recs, "tau"), "-o", markersize=3, color=color(runs.index(run)),
                    label=run.label)
        mark_epochs(ax, runs, with_label=False)
        ax.set(title="tau measured during training", xlabel="optimizer step",
               ylabel="tokens accepted per verify step", ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    notes = missing(runs, lambda r: r in ends or r in curves, "measured tau")
    return Drawn(name, title, caption, fig, run_notes=notes)


def memory(runs: list[RunData]) -> Drawn:
    name, title = "memory", "Memory of rank 0 over training"
    caption = ("Resident host memory (RSS) of rank 0's process, and on CUDA the peak device memory allocated by "
               "torch on rank 0 (a drafter), at each progress report.")
    have = [r for r in runs if np.isfinite(values(snapshots(r), "rss_gib")).any()]
    if not have:
        return no_data(name, title, caption, "no run has progress reports yet")
    scale, unit = time_unit(max_time(have))
    fig, axes = new_figure(1, 1, width=9.0, height=4.0)
    ax = axes[0, 0]
    for run in have:
        recs, c = snapshots(run), color(runs.index(run))
        t = values(recs, "_t") / scale
        ax.plot(t, values(recs, "rss_gib"), "-", color=c, label=f"{run.label}: host RSS")
        gpu = values(recs, "gpu_mem_gib")
        if np.isfinite(gpu).any():
            ax.plot(t, gpu, "--", color=c, label=f"{run.label}: GPU peak allocated")
    ax.set(title=title, xlabel=f"training time ({unit})", ylabel="memory (GiB)", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return Drawn(name, title, caption, fig, run_notes=missing(runs, lambda r: r in have, "memory readings"))


ALL = (loss_accuracy, accuracy_by_position, throughput_wait, batches_per_epoch, batch_accuracy_vs_length,
       step_accuracy_and_length, tau, memory)
