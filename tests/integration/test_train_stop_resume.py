"""Stops and resumes with real torchrun processes (gloo, CPU): SIGTERM and Ctrl-C save and resume
exactly, a dead peer ends every rank with its name, a checkpoint resumes on another layout, a finished
run restarted finishes its end-of-run work, a roll-back survives requeues."""
import json
import os
import re
import signal
import time

import helpers
import pytest
from helpers import final_digest, metrics, torchrun, wait_for, worker_pids

from dflash_dist.checkpoints.store import list_checkpoints

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them

# Long enough to interrupt mid-epoch, short enough for CI.
JOB = ["train.epochs=2", "data.synthetic.num_samples=400", "objective.num_anchors=4", "train.sync_every=2",
       "dist.dead_after_s=3", "dist.heartbeat_s=0.5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    res = torchrun(3, JOB, run_dir)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return final_digest(run_dir)


def _latest_cursor(run_dir):
    metas = sorted((run_dir / "checkpoints").glob("step-*/meta.json"))
    assert metas, "no checkpoint"
    return json.loads(metas[-1].read_text())["cursor"]


def interrupt(run_dir, overrides, at_step, act, timeout):
    """The 3-rank JOB, acted on at `at_step` (helpers.interrupt)."""
    return helpers.interrupt(3, JOB + overrides, run_dir, at_step, act, timeout)


def resume(run_dir):
    res = torchrun(3, JOB, run_dir)  # train.resume=auto is the default
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "resumed from" in out
    return out


def test_sigterm_stops_saves_and_resumes_exactly(tmp_path, reference):
    # SIGTERM to the torchrun agent, as Slurm or a user would send it.
    out, took, rc = interrupt(tmp_path, [], 6, lambda p: p.send_signal(signal.SIGTERM), 30)
    assert "stopped on request" in out, out[-3000:]
    assert len(re.findall(r"exit code 75: stopped on request", out)) == 3, "every rank exits with the resume-me code"
    assert rc != 0
    assert took < 20, f"signal to exit took {took:.1f}s"
    cursor = _latest_cursor(tmp_path)
    assert (cursor["epoch"], cursor["batch"]) != (2, 0), "the stop must land mid-run"
    meta = json.loads(sorted((tmp_path / "checkpoints").glob("step-*/meta.json"))[-1].read_text())
    assert len(meta["plan_digests"]) == 2  # what a mid-epoch resume checks its rebuilt plan against
    # Resume and finish: bitwise the uninterrupted weights.
    out2 = resume(tmp_path)
    if cursor["batch"]:
        assert f"resuming at batch {cursor['batch']}" in out2
    assert final_digest(tmp_path) == reference
    print(f"SIGTERM -> exit: {took:.2f}s")


@pytest.mark.parametrize("victim, role", [(2, "target"), (0, "drafter")])
def test_dead_peer_ends_every_rank_with_its_name_then_resume_is_exact(tmp_path, reference, victim, role):
    def kill_victim(proc):
        pids = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(worker_pids(proc.pid)), 10, "worker pids")
        os.kill(pids[victim], signal.SIGKILL)

    out, took, rc = interrupt(tmp_path, ["train.checkpoint_every_steps=3"], 7, kill_victim, 60)
    assert rc != 0
    assert took < 4 * 3 + 10, f"exit after a dead peer took {took:.1f}s"
    # The survivors say who went silent (watchdog) rather than only "connection closed".
    assert re.search(rf"rank {victim} \({role}\) (went silent|failed)", out) or \
        re.search(rf"lost {role} rank {victim}", out), out[-4000:]
    resume(tmp_path)
    assert final_digest(tmp_path) == reference
    print(f"{role} killed -> all exited: {took:.2f}s")


def test_sigterm_to_one_worker_says_what_happened_on_every_rank(tmp_path):
    def term_target(proc):
        pids = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(worker_pids(proc.pid)), 10, "worker pids")
        os.kill(pids[2], signal.SIGTERM)

    out, took, rc = interrupt(tmp_path, [], 4, term_target, 30)
    assert len(re.findall(r"exit code 75: stopped on request", out)) == 3, out[-3000:]
    assert re.search(r"\[rank2 target\].*received SIGTERM", out)
    assert re.search(r"\[rank0 drafter\] \S+: stopped on request at epoch \d+ batch \d+ \(stop requested by another "
                     r"rank\); saved", out), out[-3000:]
    assert "nan" not in re.findall(r"stopped on request[^\n]*", out)[0]


@pytest.mark.parametrize("nproc, drafters", [(3, 1), (5, 3)])
def test_a_two_drafter_checkpoint_resumes_on_another_layout(tmp_path, nproc, drafters):
    """Stopped with 2 drafters mid-epoch, resumed with 1 or 3: the rest of the same plan, every sample of
    every epoch trained once (counted), the whole run in one summary and one wandb run."""
    run = ["wandb.mode=offline"]
    helpers.interrupt(4, JOB + run + ["roles.drafters_per_node=2"], tmp_path, 3,
                      lambda p: p.send_signal(signal.SIGTERM), 30)
    cursor = _latest_cursor(tmp_path)
    assert (cursor["epoch"], cursor["batch"]) != (2, 0), "the stop must land before the end"
    res = torchrun(nproc, JOB + run + [f"roles.drafters_per_node={drafters}"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert re.search(r"resuming \S+ on another layout \(num_drafters 2 -> %d" % drafters, out), out[-3000:]
    if cursor["batch"]:  # (a loaded machine may let the stop land on the epoch boundary)
        assert f"resuming at batch {cursor['batch']}" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    counts = [e["batches"] for e in summary["epochs"]]
    assert len(counts) == 2 and summary["batches"] == sum(counts)
    kept = 400 - sum(summary["skipped"].values())  # the plan counts what it skips (no_anchor here)
    assert summary["samples"] == 2 * kept, "every sample of the plan once per epoch"
    ends = [r for r in metrics(tmp_path) if r.get("kind") == "epoch_end"]
    assert [r["batch"] for r in ends] == counts and all(r["epoch_progress"] == 1.0 for r in ends)
    ids = {d.name.rsplit("-", 1)[-1] for d in (tmp_path / "wandb").glob("offline-run-*")}
    assert len(ids) == 1, f"the resumed run continues the same wandb run: {ids}"


@pytest.mark.slow  # whole runs under torchrun
def test_ctrl_c_stops_on_every_rank_saves_and_exits_75(tmp_path):
    from helpers import progress_step, start_torchrun, wait_for
    log = tmp_path / "run.log"
    proc = start_torchrun(3, ["train.epochs=2", "data.synthetic.num_samples=400", "train.sync_every=2"], tmp_path,
                          log)
    try:
        wait_for(lambda: progress_step(tmp_path) >= 6, 120, "training to reach step 6")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C in the terminal reaches the agent; it forwards SIGINT
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert len(re.findall(r"exit code 75: stopped on request", out)) == 3, out[-3000:]
    assert "received SIGINT: stopping at the next agreed step boundary and saving" in out
    assert "SIGINT received here" in out and "KeyboardInterrupt" not in out
    assert list_checkpoints(tmp_path), "the stop saved a checkpoint"
    print(f"SIGINT -> every process gone after {took:.1f} s")


def test_a_finished_run_restarted_finishes_its_end_of_run_work_then_says_it_is_complete(tmp_path):
    job = ["train.epochs=1", "train.eval_prompts=2", "train.eval_new_tokens=8"]
    res = torchrun(3, job, tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    first = json.loads((tmp_path / "summary.json").read_text())
    # As if killed after the final checkpoint, before the evaluation, the export and the summary.
    (tmp_path / "summary.json").unlink()
    for f in (tmp_path / "export").iterdir():
        f.unlink()
    (tmp_path / "export").rmdir()
    res = torchrun(3, job, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["weights_digest"] == first["weights_digest"] and again["tau_trained"] == first["tau_trained"]
    assert again["epochs"] == first["epochs"] and again["samples"] == first["samples"]
    assert (tmp_path / "export" / "model.safetensors").is_file()
    res = torchrun(3, job, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "is complete (summary.json" in out and "nothing to do" in out


def test_a_roll_back_survives_requeues_with_auto_or_the_same_path(tmp_path):
    job = ["train.epochs=1", "train.checkpoint_every_steps=4", "train.keep_last=0"]
    res = torchrun(3, job, tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    first = json.loads((tmp_path / "summary.json").read_text())
    back = tmp_path / "checkpoints" / "step-00000004"
    res = torchrun(3, job + [f"train.resume={back}"], tmp_path)  # roll back to step 4 and train on from there
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "moved to" in out and "resumed from" in out
    (aside,) = (tmp_path / "checkpoints" / "set-aside").glob("rolled-back-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000008", "step-00000012"]
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["weights_digest"] == first["weights_digest"]  # the same steps from step 4: the same weights
    for requeue in (job + [f"train.resume={back}"], job):  # the same command line again, then auto
        res = torchrun(3, requeue, tmp_path)
        out = res.stdout + res.stderr
        assert res.returncode == 0 and "nothing to do" in out, out[-3000:]  # never from step 4 a second time
        assert "resumed from" not in out
