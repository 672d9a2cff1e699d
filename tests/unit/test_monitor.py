"""The training monitor tells the truth (issue 27 item 8, issue 29 item 8): no ETA before a rate exists,
the rate of the recent steps (not of the start-up), no line repeated while no step ends, and a
metrics.jsonl line cut by an earlier process ended before new records are appended."""
import json
import logging
import time

import pytest
import torch

from dflash_dist.config import load_config
from dflash_dist.observe.monitor import Monitor, Progress, Sinks, format_line, snapshot

CPU = torch.device("cpu")


def _sinks(tmp_path):
    return Sinks(tmp_path, load_config(None, ["wandb.mode=disabled"]).wandb, {})


def test_a_cut_last_line_is_ended_before_the_next_start_appends(tmp_path, caplog):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"kind": "step", "step": 1, "epoch": 1}) + "\n" + '{"kind": "step", "step": 2, "ep')
    with caplog.at_level(logging.WARNING, logger="dflash_dist.observe.monitor"):
        sinks = _sinks(tmp_path)
    sinks.write({"kind": "step", "step": 2, "epoch": 1}, console=False)
    sinks.close()
    lines = f.read_text().splitlines()
    assert lines[1] == '{"kind": "step", "step": 2, "ep'  # the fragment stays, alone: one bad line
    assert json.loads(lines[2]) == {"kind": "step", "step": 2, "epoch": 1}  # the new start's record intact
    assert sinks.cut_lines == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"{f}: line 2 was cut short (31 bytes without a line end, left by an interrupted write: a full disk or a "
        "kill); ended it so new records start on a line of their own; it stays, one bad line"]
    again = _sinks(tmp_path)  # a whole last line: nothing to end
    again.close()
    assert again.cut_lines == 0 and f.read_text().count("\n") == 3


def _progress(started: float) -> Progress:
    return Progress(num_epochs=1, epoch_counts=[100], epoch_batches=100, started=started)


def test_no_eta_before_two_steps_then_the_rate_of_the_recent_steps():
    from dflash_dist.observe.monitor import recent_rate
    now = time.time()
    p = _progress(started=now - 600)  # ten minutes of start-up and a slow first step
    assert snapshot(p, CPU)["eta_s"] == float("inf")
    p.total_done = p.epoch_done = p.step = 1
    p.mark(now - 10)
    assert snapshot(p, CPU)["eta_s"] == float("inf") and "ETA ?" in format_line(snapshot(p, CPU))
    for i in range(1, 11):  # then one batch a second
        p.total_done = p.epoch_done = p.step = 1 + i
        p.tokens = 1000 * i
        p.mark(now - 10 + i)
    r = snapshot(p, CPU)
    assert r["eta_s"] == pytest.approx(89.0)  # 89 batches left at 1 batch/s (the start-up's mean would say 4855 s)
    assert r["tok_per_s_recent"] == pytest.approx(1000.0)
    assert recent_rate([(0.0, 0, 0), (100.0, 10, 0), (130.0, 40, 0), (160.0, 70, 0)]) == (1.0, 0.0)  # last 60 s


class _Recorder:
    def __init__(self):
        self.records = []

    def write(self, rec, console=True, remote=True):
        self.records.append(rec)


def test_the_monitor_writes_a_line_per_progress_and_says_waiting_once_a_stall_lasts(caplog):
    p = _progress(started=time.time())
    sinks = _Recorder()
    with caplog.at_level(logging.INFO, logger="dflash_dist.observe.monitor"):
        mon = Monitor(p, sinks, 0.02, CPU, stall_s=0.4).start()
        try:
            p.total_done = p.epoch_done = p.step = 1
            p.mark()
            time.sleep(0.3)  # 15 intervals, one step: one line
            assert [r["step"] for r in sinks.records] == [1]
            p.total_done = p.epoch_done = p.step = 2
            p.mark()
            time.sleep(1.0)
        finally:
            mon.stop()
    assert [r["step"] for r in sinks.records] == [1, 2]
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting:")]
    assert 1 <= len(waiting) <= 3, waiting  # one per stall_s, not one per interval
    assert waiting[0].endswith("(last: step 2, epoch 1 batch 2/100)")
    p.activity = "rank 0 measuring tau (step 2 drafter)"  # between steps, rank 0 says what it does
    with caplog.at_level(logging.INFO, logger="dflash_dist.observe.monitor"):
        mon = Monitor(p, sinks, 0.02, CPU, stall_s=0.1).start()
        time.sleep(0.4)
        mon.stop()
    assert any(r.getMessage().endswith("(rank 0 measuring tau (step 2 drafter); last: step 2, epoch 1 batch 2/100)")
               for r in caplog.records), caplog.text
