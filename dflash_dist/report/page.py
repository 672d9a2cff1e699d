"""index.html: the runs' key figures in one table, then every figure with what to read in it, then the
figures left out and why. Plain HTML with relative image links: the folder can be copied anywhere."""
from __future__ import annotations

import html
import math
import time

from dflash_dist.report.plotting import Drawn
from dflash_dist.report.runs import RunData

ROWS = ("state", "packing", "drafters : targets", "batches per epoch (planned)", "batches trained", "optimizer steps",
        "samples", "tokens", "training time", "throughput", "final loss", "last epoch: mean loss, accuracy",
        "tau before training", "tau after training",
        "accept_len (training batches, teacher-forced)", "samples skipped (plan)", "samples skipped (preparation)",
        "non-finite steps skipped")


def _num(v, fmt: str = "{:,}") -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v)


def _tau(v) -> str:
    if not isinstance(v, dict) or not isinstance(v.get("tau"), (int, float)):
        return "not measured"
    return f"{v['tau']:.3f} ({v.get('num_prompts', '?')} prompts)"


def _skips(d) -> str:
    if not isinstance(d, dict) or not any(d.values()):
        return "none" if isinstance(d, dict) else "-"
    return ", ".join(f"{k} {n:,}" for k, n in d.items() if n)


def _last_epoch(run: RunData) -> str:
    """Mean loss and accuracy over the last epoch's steps: steadier than the last step's for comparisons."""
    steps = run.steps()
    if not steps:
        return "-"
    last = [r for r in steps if r.get("epoch") == steps[-1].get("epoch")]
    loss = [r["loss"] for r in last if isinstance(r.get("loss"), (int, float))]
    acc = [r["acc"] for r in last if isinstance(r.get("acc"), (int, float))]
    if not loss or not acc:
        return "-"
    return f"{sum(loss) / len(loss):.4f}, {sum(acc) / len(acc):.4f} (epoch {last[0].get('epoch')}, {len(last)} steps)"


def key_figures(run: RunData) -> dict[str, str]:
    """The table's column for one run: the summary's figures, or while it runs, its last snapshot's."""
    s, plan = run.summary or {}, run.plan()
    snaps = [r for r in run.records if "tokens" in r and r.get("kind", "progress") != "step" and "batch" in r]
    last = snaps[-1] if snaps else {}
    trained = [e.get("batches") for e in s.get("epochs", [])] if s else []
    return {
        "state": run.state(),
        "packing": plan.get("packing", "-"),
        "drafters : targets": f"{plan['num_drafters']} : {plan['num_targets']}" if "num_drafters" in plan else "-",
        "batches per epoch (planned)": ", ".join(map(str, plan.get("epoch_counts") or s.get("planned_batches") or []))
        or "-",
        "batches trained": ", ".join(map(str, trained)) if trained else _num(last.get("step")) + " steps so far",
        "optimizer steps": _num(s.get("steps", last.get("step"))),
        "samples": _num(s.get("samples", last.get("samples"))),
        "tokens": _num(s.get("tokens", last.get("tokens"))),
        "training time": _num(s.get("time_s", last.get("time")), "{:,.1f} s"),
        "throughput": _num(s.get("tok_per_s", last.get("tok_per_s")), "{:,.0f} tokens/s"),
        "final loss": _num(s.get("final_loss", last.get("loss")), "{:.4f}"),
        "last epoch: mean loss, accuracy": _last_epoch(run),
        "tau before training": _tau(s.get("tau_untrained")) if s else "-",
        "tau after training": _tau(s.get("tau_trained")) if s else "-",
        "accept_len (training batches, teacher-forced)": _num(s.get("final_accept_len_estimate", last.get("accept_len")), "{:.3f}"),
        "samples skipped (plan)": _skips(s.get("skipped")) if s else "-",
        "samples skipped (preparation)": _skips(s.get("skipped_in_preparation")) if s else "-",
        "non-finite steps skipped": _num(s.get("skipped_nonfinite_steps", last.get("skipped_steps"))),
    }


def render(runs: list[RunData], drawn: list[Drawn]) -> str:
    e = html.escape
    cols = [key_figures(r) for r in runs]
    head = "".join(f"<th>{e(r.label)}<br><small>{e(str(r.path))}</small></th>" for r in runs)
    body = "".join(f"<tr><th>{e(k)}</th>" + "".join(f"<td>{e(c[k])}</td>" for c in cols) + "</tr>" for k in ROWS)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>dflash_dist run report: "
             f"{e(', '.join(r.label for r in runs))}</title><style>{_CSS}</style></head><body>",
             f"<h1>Run report</h1><p>{len(runs)} run(s); made {e(time.strftime('%Y-%m-%d %H:%M:%S %Z'))} from "
             "each run's metrics.jsonl and summary.json.</p>",
             f"<table><tr><th></th>{head}</tr>{body}</table>"]
    run_notes = [n for r in runs for n in r.notes]
    for d in drawn:
        if d.figure is None:
            continue
        parts.append(f"<figure id='{e(d.name)}'><h2>{e(d.title)}</h2><img src='{e(d.name)}.png' alt='{e(d.title)}'>"
                     f"<figcaption>{e(d.caption)}</figcaption></figure>")
        run_notes += [f"{d.title}: {n}" for n in d.run_notes]
    left_out = [d for d in drawn if d.figure is None]
    if left_out:
        parts.append("<h2>Figures left out</h2><ul>" + "".join(
            f"<li><b>{e(d.title)}</b>: {e(d.note)}</li>" for d in left_out) + "</ul>")
    if run_notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in run_notes) + "</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


_CSS = ("body{font-family:sans-serif;max-width:1400px;margin:1em auto;padding:0 1em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
        "figure{margin:2em 0}img{max-width:100%;border:1px solid #eee}figcaption{color:#444;max-width:70em}")
