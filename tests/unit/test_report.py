"""The run report's reading of metrics files: damaged and cut records, an unwritable out folder, a resumed
run's time axis, smoothing a short run."""
from __future__ import annotations

import json

import pytest

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
    from helpers import read_only

    from dflash_dist.report.__main__ import main
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(PLAN)
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        assert main([str(tmp_path / "run"), "--out", str(tmp_path / "ro")]) == 2
        assert f"error: --out {tmp_path / 'ro'}: cannot write in it: " in capsys.readouterr().err
        assert main([str(tmp_path / "run"), "--out", str(tmp_path / "ro" / "new")]) == 2
        assert f"error: --out {tmp_path / 'ro' / 'new'}: cannot create it: " in capsys.readouterr().err


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
