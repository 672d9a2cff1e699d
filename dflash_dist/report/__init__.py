"""The run report: `python -m dflash_dist.report RUN_DIR [RUN_DIR ...] [--out DIR]`.

Reads each run's `metrics.jsonl` and `summary.json` (nothing else, so it runs anywhere the two files are,
during a run or after it, with no wandb account) and writes PNG figures and an `index.html` that shows
them beside the runs' key figures. Several runs share each figure's axes, for comparisons. A figure whose
data no run has (tau when evaluation was off, say) is left out, and the page says why.

    runs.py     the records of a run directory, by kind
    figures.py  one function per figure
    plotting.py what the figures share (colours, smoothing, the time unit)
    page.py     index.html

May import: io/ (its files.py only, standard library only), so it runs on any machine.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_dist.io.files import atomic_write, check_output_dir
from dflash_dist.report.runs import ReportInputError, RunData, load_run

log = logging.getLogger(__name__)

__all__ = ["ReportInputError", "Report", "load_run", "make_report"]


@dataclass
class Report:
    index: Path
    figures: list[Path]  # PNG files written, in page order
    left_out: dict[str, str]  # figure name -> why it was not drawn


def make_report(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Report:
    """Load the runs, draw every figure that has data, write `out/NAME.png` and `out/index.html`. Raises
    ReportInputError for a run that cannot be read, OutputPathError (naming --out) for an `out` that cannot
    be created or written, found before any figure is drawn."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display, even where one is set
    from dflash_dist.report import figures, page

    if labels is not None and len(labels) != len(run_dirs):
        raise ReportInputError(f"--labels: {len(labels)} labels for {len(run_dirs)} run directories")
    runs = [load_run(Path(d), labels[i] if labels else None) for i, d in enumerate(run_dirs)]
    _unique_labels(runs)
    out = check_output_dir(out, "--out")
    drawn, written, left_out = [], [], {}
    for make in figures.ALL:
        d = make(runs)
        drawn.append(d)
        if d.figure is None:
            left_out[d.name] = d.note
            log.info("left out %s: %s", d.name, d.note)
            continue
        path = out / f"{d.name}.png"
        atomic_write(path, lambda f, fig=d.figure: fig.savefig(f, format="png"))  # a rerun while the page is open: old or new
        written.append(path)
    index = out / "index.html"
    atomic_write(index, page.render(runs, drawn))
    return Report(index, written, left_out)


def _unique_labels(runs: list[RunData]) -> None:
    """Two runs of the same directory name get their parent's name too, so legends tell them apart."""
    names = [r.label for r in runs]
    for r in runs:
        if names.count(r.label) > 1:
            r.label = f"{r.path.resolve().parent.name}/{r.label}"
