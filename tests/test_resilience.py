"""Resume, preemption and dead peers with real torchrun processes (gloo, CPU)."""
import json
import os
import re
import signal
import time

import pytest

from helpers import final_digest, progress_step, start_torchrun, torchrun, wait_for, worker_pids

# Long enough to interrupt mid-epoch, short enough for CI.
JOB = ["train.epochs=2", "data.synthetic.num_samples=400", "objective.num_anchors=4", "train.sync_every=2",
       "dist.dead_after_s=3", "dist.heartbeat_s=0.5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    res = torchrun(3, JOB, run_dir)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return final_digest(res.stdout + res.stderr)


def _latest_cursor(run_dir):
    metas = sorted((run_dir / "checkpoints").glob("step-*/meta.json"))
    assert metas, "no checkpoint"
    return json.loads(metas[-1].read_text())["cursor"]


def test_sigterm_stops_saves_and_resumes_exactly(tmp_path, reference):
    log1 = tmp_path / "first.log"
    proc = start_torchrun(3, JOB, tmp_path, log1)
    try:
        wait_for(lambda: progress_step(tmp_path) >= 6, 120, "training to reach step 6")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to the torchrun agent, as Slurm or a user would
        proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log1.read_text()
    assert "stopped on request" in out, out[-3000:]
    assert len(re.findall(r"exit code 75: stopped on request", out)) == 3, "every rank exits with the resume-me code"
    assert proc.returncode != 0
    assert took < 20, f"signal to exit took {took:.1f}s"
    cursor = _latest_cursor(tmp_path)
    assert (cursor["epoch"], cursor["step"]) != (2, 0), "the stop must land mid-run"
    # Resume (train.resume=auto is the default) and finish: bitwise the uninterrupted weights.
    res = torchrun(3, JOB, tmp_path)
    out2 = res.stdout + res.stderr
    assert res.returncode == 0, out2[-3000:]
    assert "resumed from" in out2
    if cursor["step"]:
        assert f"resuming at step {cursor['step']}" in out2
    assert final_digest(out2) == reference
    print(f"SIGTERM -> exit: {took:.2f}s")


@pytest.mark.parametrize("victim, role", [(2, "target"), (0, "drafter")])
def test_dead_peer_ends_every_rank_with_its_name_then_resume_is_exact(tmp_path, reference, victim, role):
    log1 = tmp_path / "first.log"
    proc = start_torchrun(3, JOB + ["train.checkpoint_every_steps=3"], tmp_path, log1)
    try:
        wait_for(lambda: progress_step(tmp_path) >= 7, 120, "training to reach step 7")
        pids = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(worker_pids(proc.pid)), 10, "worker pids")
        t0 = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log1.read_text()
    assert proc.returncode != 0
    assert took < 4 * 3 + 10, f"exit after a dead peer took {took:.1f}s"
    # The survivors say who went silent (watchdog) rather than only "connection closed".
    assert re.search(rf"rank {victim} \({role}\) (went silent|failed)", out) or \
        re.search(rf"lost {role} rank {victim}", out), out[-4000:]
    res = torchrun(3, JOB, tmp_path)
    out2 = res.stdout + res.stderr
    assert res.returncode == 0, out2[-3000:]
    assert "resumed from" in out2 and final_digest(out2) == reference
    print(f"{role} killed -> all exited: {took:.2f}s")
