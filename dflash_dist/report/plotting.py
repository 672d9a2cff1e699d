"""What every figure of the report shares: one colour per run, the smoothing of per-step curves, the
time axis unit, epoch boundaries, and the `Drawn` result (a figure, or the note that says why not)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from matplotlib.figure import Figure

from dflash_dist.report.runs import RunData

DPI = 100


@dataclass
class Drawn:
    name: str  # file stem: NAME.png
    title: str
    caption: str  # what to read in it
    figure: Figure | None  # None: left out (no run has its data), `note` says why
    note: str = ""
    run_notes: list[str] = field(default_factory=list)  # runs drawn without this figure's data


def color(i: int) -> str:
    return f"C{i % 10}"


def new_figure(rows: int, cols: int, width: float = 11.0, height: float = 3.6, **kw) -> tuple[Figure, np.ndarray]:
    """A figure of rows x cols panels, laid out so that titles, labels and legends do not overlap."""
    fig = Figure(figsize=(width, height * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes


def values(recs: list[dict], key: str) -> np.ndarray:
    """The records' `key` as floats; missing or null (NaN written as null) is NaN."""
    out = np.full(len(recs), np.nan)
    for i, r in enumerate(recs):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[i] = float(v)
    return out


def smooth(y: np.ndarray, window: int | None = None) -> tuple[np.ndarray, int]:
    """A centred moving mean over `window` points (default: about 2% of them, at most 101), NaNs left
    out. Returns the smoothed curve and the window, so a legend can say what was averaged."""
    n = len(y)
    w = window or max(1, min(101, n // 50))
    if w % 2 == 0:
        w += 1
    if w == 1 or n == 0:
        return y.copy(), 1
    ok = np.isfinite(y)
    kernel = np.ones(w)
    # "full", centred by hand: "same" returns max(n, w) points, so a run shorter than the window broke
    centre = slice((w - 1) // 2, (w - 1) // 2 + n)
    num = np.convolve(np.where(ok, y, 0.0), kernel, mode="full")[centre]
    den = np.convolve(ok.astype(float), kernel, mode="full")[centre]
    return np.divide(num, den, out=np.full(n, np.nan), where=den > 0), w


def time_unit(max_seconds: float) -> tuple[float, str]:
    """Divisor and unit name for a time axis: seconds up to 5 minutes, minutes up to 5 hours, then hours."""
    if not math.isfinite(max_seconds) or max_seconds <= 300:
        return 1.0, "s"
    if max_seconds <= 5 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def max_time(runs: list[RunData]) -> float:
    return max((r.get("_t", 0.0) for run in runs for r in run.records), default=0.0)


def epoch_steps(run: RunData) -> list[int]:
    """Optimizer steps at which the run's epochs ended, but the last (the end of the curve)."""
    ends = sorted({r["step"] for r in run.kind("epoch_end") if isinstance(r.get("step"), int)})
    last = max((r["step"] for r in run.steps()), default=None)
    return [s for s in ends if s != last]


def mark_epochs(ax, runs: list[RunData], with_label: bool) -> None:
    """Dotted vertical lines in each run's colour where its epochs ended."""
    labelled = False
    for i, run in enumerate(runs):
        for s in epoch_steps(run):
            ax.axvline(s, color=color(i), linestyle=":", linewidth=1.2, alpha=0.8,
                       label="epoch boundary" if with_label and not labelled else None)
            labelled = True


def no_data(name: str, title: str, caption: str, note: str) -> Drawn:
    return Drawn(name, title, caption, None, note)


def missing(runs: list[RunData], has, what: str) -> list[str]:
    """Notes for the runs that lack `what` (has(run) is False)."""
    return [f"{run.label}: no {what}" for run in runs if not has(run)]


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(x[ok], y[ok])[0, 1])
