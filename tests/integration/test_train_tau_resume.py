"""tau every 6 steps and a checkpoint every 6 steps, the job SIGKILLed right after step 6's tau record,
then resumed (torchrun, gloo): the tau of step 6 is in summary.json, once in the report, and once in
metrics.jsonl (issue 46, case 13): the killed process's record, of the same weights, moved to
metrics.superseded.jsonl, as its records of the steps after the checkpoint."""
import json
import os
import re
import signal

import pytest
from helpers import metrics, start_torchrun, torchrun, wait_for, worker_pids

from dflash_dist.report.runs import load_run

pytestmark = pytest.mark.slow  # whole runs under torchrun

JOB = ["train.epochs=1", "data.synthetic.num_samples=240", "objective.num_anchors=4", "train.eval_every_steps=6",
       "train.checkpoint_every_steps=6", "train.eval_prompts=2", "train.eval_new_tokens=8", "dist.dead_after_s=3",
       "dist.heartbeat_s=0.5"]


def _taus(run_dir):
    try:
        return [r["step"] for r in metrics(run_dir) if r.get("kind") == "tau"]
    except (FileNotFoundError, json.JSONDecodeError):  # not yet, or a line being written
        return []


def kill_after_tau_6(run_dir) -> bool:
    """Start JOB and SIGKILL the whole job as soon as step 6's tau is recorded; True when the kill landed
    in the window this test is about: after that record, before step 12's checkpoint (six tiny steps)."""
    proc = start_torchrun(3, JOB, run_dir, run_dir / "first.log")
    try:
        wait_for(lambda: 6 in _taus(run_dir), 180, "step 6's tau record", poll=0.02)
        for pid in [*worker_pids(proc.pid).values(), proc.pid]:  # the whole job at once, no clean-up
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return [p.name for p in sorted((run_dir / "checkpoints").glob("step-*[0-9]"))][-1:] == ["step-00000006"]


def test_a_kill_right_after_a_checkpoints_tau_loses_and_duplicates_no_tau(tmp_path_factory):
    # The kill races six training steps: a try where it came too late (this process not scheduled in
    # time on a loaded machine) is started again in a fresh directory; what is asserted is unchanged.
    for attempt in range(3):
        tmp_path = tmp_path_factory.mktemp(f"try{attempt}")
        if kill_after_tau_6(tmp_path):
            break
    else:
        pytest.fail("three tries, and the kill never landed between step 6's tau and step 12's checkpoint")
    assert not (tmp_path / "summary.json").exists(), "killed before the end"
    res = torchrun(3, JOB, tmp_path, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert re.search(r"resumed from \S*step-00000006", out), out[-3000:]  # the checkpoint of step 6

    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = summary["steps"]
    want = [0] + list(range(6, steps, 6)) + [steps]
    assert [t["step"] for t in summary["tau_during_training"]] == want
    run = load_run(tmp_path)
    assert [r["step"] for r in run.taus()] == want  # what the report draws
    assert [r["tau"] for r in run.taus()] == [t["tau"] for t in summary["tau_during_training"]]
    records = metrics(tmp_path)
    assert [r["step"] for r in records if r.get("kind") == "tau"] == want  # one record per measured step
    assert [r["step"] for r in records if r.get("kind") == "step"] == list(range(1, steps + 1))
    aside = [json.loads(line) for line in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    six = [r for r in aside if r.get("kind") == "tau"]
    assert [r["step"] for r in six] == [6], aside  # the killed process's, of the same weights as the new one
    assert six[0]["tau"] == next(r["tau"] for r in records if r.get("kind") == "tau" and r["step"] == 6)
    assert all(r["step"] > 6 for r in aside if r.get("kind") == "step")
