"""The run report (python -m dflash_dist.report) on runs made here, and a plan.packing=sorted run."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import epoch_lines, metrics, torchrun

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
    counts = [n for n, _ in epoch_lines(log)[0]]
    assert len(counts) == 3 and len(set(counts)) == 1, counts
    n = counts[0]
    recs = metrics(run_dir)
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
    fill_counts = [c for c, _ in epoch_lines(logs["fill"])[0]]
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



PLAN = b'{"kind": "plan", "epoch_counts": [3]}\n'


@pytest.mark.parametrize("line, says", [
    (b'{"kind": "step", "epoch": 1, "loss": 2.0}', "a 'step' record without 'step'"),
    (b'{"kind": "step", "step": "7", "epoch": 1}', "'step' is \"7\", not a whole number >= 0"),
    (b'{"kind": "step", "step": 7, "epoch": 1.5}', "'epoch' is 1.5, not a whole number >= 0"),
    (b'{"kind": "epoch_end", "step": 7}', "a 'epoch_end' record without 'epoch'"),
    (b'{"kind": ["step"], "step": 7}', "'kind' is [\"step\"], not a string"),
    (b'{"kind": "progress", "step": 3, "loss": "\xff\xfe"}', "not UTF-8 text (byte 42 of the line)"),
])
def test_a_damaged_record_exits_2_naming_the_file_and_line(tmp_path, capsys, line, says):
    from dflash_dist.report.__main__ import main
    (tmp_path / "metrics.jsonl").write_bytes(PLAN + line + b"\n" + PLAN)
    assert main([str(tmp_path)]) == 2
    assert f"error: {tmp_path / 'metrics.jsonl'}:2: {says}" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()  # refused before anything is written


def test_a_record_cut_by_a_full_disk_and_glued_to_the_next_is_named_and_the_next_kept(tmp_path):
    """A writer that died mid-line (ENOSPC) and a resumed process appending its first record to that line:
    the cut record is lost (named in the page's notes), the whole one after it is read."""
    from dflash_dist.report import load_run
    step = b'{"kind": "step", "step": 1, "epoch": 1, "time": 1.0, "loss": 9.0}\n'
    (tmp_path / "metrics.jsonl").write_bytes(PLAN + step + b'{"kind": "step", "step": 2, "ep'
                                             + b'{"kind": "plan", "step": 1, "epoch_counts": [3]}\n' + step)
    run = load_run(tmp_path)
    assert [r["kind"] for r in run.records] == ["plan", "step", "plan", "step"]
    assert run.notes == ["metrics.jsonl: line 3 starts with a record cut short (a full disk, or a kill mid-write), "
                         "which was not read; the record after it on the same line was"]
    (tmp_path / "metrics.jsonl").write_bytes(PLAN + b'{"kind": "step", "step": 2, "ep{"not a record\n' + step)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        load_run(tmp_path)


@pytest.mark.parametrize("cut", [b'{"kind": "step", "step": 2, "ep', b'{"kind": "step", "step": 2, "loss": 0.4',
                                 b'{"kind": "step", "step": 2, "ok": tr', b'{"kind": "step", "step": 2, "loss": -1.5e'])
def test_a_record_cut_short_and_ended_by_the_next_process_is_named_not_fatal(tmp_path, cut):
    """The monitor ends a cut last line before it appends: the cut record stays, alone on its line."""
    from dflash_dist.report import load_run
    step = b'{"kind": "step", "step": 1, "epoch": 1, "time": 1.0, "loss": 9.0}\n'
    (tmp_path / "metrics.jsonl").write_bytes(PLAN + step + cut + b"\n" + PLAN + step)
    run = load_run(tmp_path)
    assert [r["kind"] for r in run.records] == ["plan", "step", "plan", "step"]
    assert run.notes == ["metrics.jsonl: line 3 is a record cut short (a full disk, or a kill mid-write) and was "
                         "not read"]


@pytest.mark.parametrize("bad", [b'{"kind": "step", "step": 2, "ok": x}', b'{"kind": "step"} tail', b'garbage'])
def test_a_damaged_line_that_is_not_a_cut_record_is_still_refused(tmp_path, bad):
    from dflash_dist.report import load_run
    (tmp_path / "metrics.jsonl").write_bytes(PLAN + bad + b"\n" + PLAN)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        load_run(tmp_path)


def test_an_unwritable_out_folder_exits_2_naming_it(tmp_path, capsys):
    from dflash_dist.report.__main__ import main
    from helpers import read_only
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(PLAN)
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        assert main([str(tmp_path / "run"), "--out", str(tmp_path / "ro")]) == 2
        assert f"error: --out {tmp_path / 'ro'}: cannot write in it: " in capsys.readouterr().err
        assert main([str(tmp_path / "run"), "--out", str(tmp_path / "ro" / "new")]) == 2
        assert f"error: --out {tmp_path / 'ro' / 'new'}: cannot create it: " in capsys.readouterr().err


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


def test_a_resumed_run_is_one_time_axis_and_a_repeated_step_counts_once(tmp_path):
    """A resumed run appends to metrics.jsonl: a new `plan` record, times from 0 again, and the steps
    after the checkpoint it resumed from recorded a second time (the later ones are the ones kept)."""
    from dflash_dist.report import load_run
    lines = [{"kind": "plan", "step": 0, "epoch_counts": [4]}]
    lines += [{"kind": "step", "step": s, "epoch": 1, "time": 1.0 * s, "step_batches": 1, "loss": 9.0}
              for s in (1, 2, 3)]
    lines += [{"kind": "progress", "step": 3, "time": 3.5, "tokens": 30, "batch": 3}]
    lines += [{"kind": "plan", "step": 2, "epoch_counts": [4]}]  # resumed from the checkpoint of step 2
    lines += [{"kind": "step", "step": s, "epoch": 1, "time": 1.0 * (s - 2), "step_batches": 1, "loss": 1.0}
              for s in (3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = load_run(tmp_path)
    steps = run.steps()
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["loss"] for s in steps] == [9.0, 9.0, 1.0, 1.0]  # step 3 as the resumed process trained it
    times = [r["_t"] for r in run.records if "_t" in r]
    assert times == [1.0, 2.0, 3.0, 3.5, 4.5, 5.5]  # the second process continues after the first
    assert run.state().startswith("running, or ended without a summary")


def test_smooth_keeps_the_length_of_a_run_shorter_than_its_window():
    """A run shorter than the window broke np.convolve's "same" mode, which returns max(n, w) points: the
    real recipe's test run, 5 steps in its last epoch under the report's 9-point detrending, hit it."""
    import numpy as np
    from dflash_dist.report.plotting import smooth
    y = np.array([1.0, 2.0, np.nan, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    out, w = smooth(y, 21)
    assert w == 21 and out.shape == y.shape
    assert np.allclose(out, np.nanmean(y))  # every point's window holds the whole run: its mean, NaN left out
    out, w = smooth(np.arange(10.0), 3)
    assert w == 3 and np.allclose(out[1:-1], np.arange(1.0, 9.0)) and out[0] == 0.5 and out[-1] == 8.5
