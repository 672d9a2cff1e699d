"""The run report (python -m dflash_dist.report) as a real process, on runs made here under torchrun,
and a plan.packing=sorted run: every figure, a figure without data, one batch count everywhere, a run
still writing, bad input and labels."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import metrics, torchrun


@pytest.mark.slow
def test_report_of_two_runs_draws_every_figure_and_one_page(runs, tmp_path):
    dirs, _ = runs
    out = tmp_path / "report"
    r = report(dirs["fill"], dirs["sorted"], "--out", out)
    assert r.returncode == 0, r.stderr
    page = (out / "index.html").read_text()
    pngs = sorted(out.glob("*.png"))
    assert {p.stem for p in pngs} == set(FIGURES)  # tau too: one of the runs measured it
    for p in pngs:
        w, h = png_size(p)
        assert w >= 700 and h >= 350 and p.stat().st_size > 15_000, (p.name, w, h, p.stat().st_size)
        assert page.count(f"src='{p.name}'") == 1
        assert str(p) in r.stdout
    for label in ("fill", "sorted"):
        assert f"<th>{label}<br>" in page
    assert "Figures left out" not in page
    assert "sorted: no measured tau" in page  # the run without it is named, not drawn as zero


@pytest.mark.slow
def test_a_figure_without_data_is_left_out_with_a_note(runs, tmp_path):
    dirs, _ = runs
    out = tmp_path / "report"
    r = report(dirs["sorted"], "--out", out)
    assert r.returncode == 0, r.stderr
    assert not (out / "tau.png").exists()
    assert {p.stem for p in out.glob("*.png")} == set(FIGURES) - {"tau"}
    page = (out / "index.html").read_text()
    assert "tau.png" not in page
    assert re.search(r"Figures left out</h2><ul><li><b>Acceptance length tau[^<]*</b>: no run measured tau", page)
    assert "left out tau: no run measured tau" in r.stdout


@pytest.mark.slow
def test_sorted_run_has_one_batch_count_that_monitor_summary_and_report_show(runs, tmp_path):
    dirs, logs = runs
    run_dir, log = dirs["sorted"], logs["sorted"]
    recs = metrics(run_dir)
    (plan,) = [rec for rec in recs if rec.get("kind") == "plan"]  # the counts rank 0 broadcast at start
    counts = plan["epoch_counts"]
    assert len(counts) == 3 and len(set(counts)) == 1, counts
    n = counts[0]
    # monitor: every progress line of every epoch counts against the same n
    assert {rec["batches_per_epoch"] for rec in recs if rec.get("kind") in ("progress", "epoch_end")} == {n}
    assert re.search(rf"epoch 3/3  batch {n}/{n} \(100%\)", log)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["planned_batches"] == [n] * 3 and [e["batches"] for e in summary["epochs"]] == [n] * 3
    assert sum(r["step_batches"] for r in recs if r.get("kind") == "step") == 3 * n  # every batch trained once
    # it trains: the last epoch's mean loss is well below the first steps'
    steps = [r for r in recs if r.get("kind") == "step"]
    first, last = [s["loss"] for s in steps[:3]], [s["loss"] for s in steps if s["epoch"] == 3]
    assert sum(last) / len(last) < 0.85 * sum(first) / len(first)
    # report: the page's table gives the same count for each epoch, planned and trained
    out = tmp_path / "report"
    assert report(run_dir, "--out", out).returncode == 0
    page = (out / "index.html").read_text()
    assert page.count(f"<td>{n}, {n}, {n}</td>") == 2 and "<td>sorted</td>" in page
    # the fill run repacks every epoch: its counts are its own, per epoch, in the same table row
    fill_counts = [rec["batches_per_epoch"] for rec in metrics(dirs["fill"]) if rec.get("kind") == "epoch_end"]
    assert json.loads((dirs["fill"] / "summary.json").read_text())["planned_batches"] == fill_counts


def test_bad_input_exits_2_naming_the_file_and_line(tmp_path):
    r = report(tmp_path / "nowhere")
    assert r.returncode == 2 and "nowhere: not a directory" in r.stderr
    (tmp_path / "empty").mkdir()
    r = report(tmp_path / "empty")
    assert r.returncode == 2 and "metrics.jsonl: not found" in r.stderr
    run = tmp_path / "bad"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "plan", "epoch_counts": [3]}\nnot json\n{"kind": "step"}\n')
    r = report(run)
    assert r.returncode == 2 and f"{run / 'metrics.jsonl'}:2: not a JSON record" in r.stderr
    assert not (run / "report").exists()
    (run / "metrics.jsonl").write_text('{"kind": "plan", "epoch_counts": [3]}\n')
    (run / "summary.json").write_text("{")
    r = report(run)
    assert r.returncode == 2 and "summary.json: cannot be read as JSON" in r.stderr


@pytest.mark.slow
def test_a_run_still_writing_is_reported_from_what_is_there(runs, tmp_path):
    """During a run: no summary yet, and a last line cut short. The page says so; nothing fails."""
    dirs, _ = runs
    live = tmp_path / "live"
    live.mkdir()
    lines = (dirs["sorted"] / "metrics.jsonl").read_text().splitlines()
    cut = [i for i, line in enumerate(lines) if '"kind": "epoch_end"' in line][1]  # two epochs in
    (live / "metrics.jsonl").write_text("\n".join(lines[:cut + 1]) + "\n" + lines[cut + 1][:20])
    r = report(live)
    assert r.returncode == 0, r.stderr
    page = (live / "report" / "index.html").read_text()
    assert "running, or ended without a summary" in page
    assert f"metrics.jsonl: line {cut + 2} is incomplete" in page
    assert (live / "report" / "batch_accuracy_vs_length.png").exists()


def test_labels_must_match_the_runs(tmp_path):
    run = tmp_path / "a"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "plan", "epoch_counts": [3]}\n')
    r = report(run, "--labels", "x,y")
    assert r.returncode == 2 and "--labels: 2 labels for 1 run directories" in r.stderr


FIGURES = ("loss_accuracy", "accuracy_by_position", "throughput_wait", "batches_per_epoch",
           "batch_accuracy_vs_length", "step_accuracy_and_length", "tau", "memory")


def report(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_dist.report", *map(str, args)], capture_output=True,
                          text=True, timeout=180)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two small whole runs: `fill` measuring tau, `sorted` with evaluation off. Returns (dirs, logs)."""
    root = tmp_path_factory.mktemp("runs")
    jobs = {"fill": ["plan.packing=fill", "train.eval_prompts=3", "train.eval_new_tokens=16"],
            "sorted": ["plan.packing=sorted"]}
    dirs, logs = {}, {}
    for name, overrides in jobs.items():
        r = torchrun(2, overrides + ["monitor.interval_s=0.1"], root / name)
        assert r.returncode == 0, r.stderr[-3000:]
        dirs[name], logs[name] = root / name, r.stderr + r.stdout
    return dirs, logs
