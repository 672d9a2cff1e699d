"""slurm/train.sbatch under a real one-node Slurm started here (launch/slurm_local.sh: slurmctld, slurmd
and munged from Debian's slurm-wlm and munge): a job that completes; one job stopped by Slurm's own
time-limit warning, then by a warning sent by hand, then by a rank killed -9, requeued and resumed each
time to the uninterrupted weights; a plain scancel that saves and stays cancelled; no GPUs and no NPROC.
tests/integration/test_run_sh.py: launch/run.sh and the scripts without Slurm."""
import os
import re
import signal
import time
from pathlib import Path

import helpers
import pytest
from helpers import final_digest, wait_for
from slurm_cluster import SlurmCluster

# The Slurm tests' job: 5262 steps, at most ~60 a second on the idle 2-core CPU machine (a clean-clone CI
# run trained 1754 of them in 30 s; 12 a second when it is busy), so about 90 s of training at least: long
# enough for the time-limit warning, which Slurm sends 25-56 s after the start of a 2-minute job with
# --signal=USR2@65 (it checks limits every 30 s), to land during training, after the start-up (6 s idle,
# 17 s busy).
JOB = helpers.TINY + ["train.epochs=24", "data.synthetic.num_samples=3000", "data.synthetic.regenerate=false",
                      "train.sync_every=2", "train.checkpoint_every_steps=50", "monitor.interval_s=0.5",
                      "dist.dead_after_s=3", "dist.heartbeat_s=0.5"]
SLURM_ENV = {"NPROC": "3", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    yield c
    c.stop()


def steps_saved(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*[0-9]"))


def run_job(cluster, tmp_path: Path, sbatch_opts=(), env=None) -> tuple[int, Path, Path]:
    """Submit JOB from a directory outside the repository; returns (job id, its log, its run dir)."""
    where = tmp_path / "submitted_from"
    where.mkdir()
    run_dir = tmp_path / "run"
    job = cluster.submit(JOB + [f"train.run_dir={run_dir}"], list(sbatch_opts), where, dict(SLURM_ENV, **(env or {})))
    return job, where / f"dflash-{job}.out", run_dir


def finish(cluster, job: int, log: Path, timeout: float) -> tuple[dict, str]:
    info = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout)
    return info, log.read_text(errors="replace")


def training_started(run_dir: Path, after_step: int = 0) -> int:
    """Waits for a checkpoint after `after_step` (the job is training); returns its step."""
    return wait_for(lambda: max([s for s in steps_saved(run_dir) if s > after_step], default=0), 240,
                    f"a checkpoint after step {after_step}")


@pytest.fixture(scope="module")
def completed(cluster, tmp_path_factory):
    """The job run once without interruption: (scontrol's record, its log, its run dir)."""
    job, log, run_dir = run_job(cluster, tmp_path_factory.mktemp("complete"))
    return (*finish(cluster, job, log, 600), run_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_completes(cluster, completed):
    info, out, _ = completed
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-3000:]
    assert "1 node(s) x 3 ranks" in out, "NPROC is honoured without GPUs"
    assert "local ranks' exit codes: 0 0 0 -> exit 0" in out and "slurm: training done" in out
    final_digest(completed[2])


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_time_limit_warning_a_stop_by_hand_and_a_killed_rank_each_requeue_and_resume_exactly(
        cluster, completed, tmp_path):
    """One job, stopped three ways, resumed each time; the weights end bitwise as uninterrupted.
    1. A 2-minute limit with --signal=USR2@65: Slurm itself sends the warning to the step (nobody else
       signals anything); the ranks save and exit 75; the script requeues. The limit is then raised (as
       an operator would) so that the resumed job is not warned again: that would only repeat step 1.
    2. `scancel --signal=USR2 --batch`: the script passes the stop to the step; the same.
    3. A rank killed -9: the others exit, the script requeues it as a failure (counted) and it resumes
       from the last periodic checkpoint."""
    job, log, run_dir = run_job(cluster, tmp_path, ["--time=2", "--signal=USR2@65"])
    info = wait_for(lambda: (lambda i: i if i["Restarts"] == "1" or i["JobState"] == "COMPLETED" else None)(
        cluster.job(job)), 300, "the time-limit warning's requeue")
    assert info["Restarts"] == "1", "the job finished before Slurm's warning: make JOB longer"
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=30")
    training_started(run_dir, max(steps_saved(run_dir)))
    cluster.signal(job, "--signal=USR2", "--batch")
    wait_for(lambda: cluster.job(job)["Restarts"] == "2", 120, "the requeue after the stop by hand")
    training_started(run_dir, max(steps_saved(run_dir)))
    rank2 = wait_for(lambda: worker_pid(job, rank=2), 30, "rank 2 of the resumed job")
    os.kill(rank2, signal.SIGKILL)
    info, out = finish(cluster, job, log, 600)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "3"), out[-4000:]
    assert info["Comment"] == "dflash-failures=1"
    by_slurm = re.search(r"stopped on request at epoch \d+ batch \d+ \(SIGUSR2 received here", out)
    assert by_slurm and by_slurm.start() < out.index("slurm: SIGUSR2 to the batch script"), \
        "the first stop is Slurm's own warning"
    assert out.count("dflash_dist.parallel.stop: received SIGUSR2") == 6, "every rank gets each stop request"
    assert out.count("local ranks' exit codes: 75 75 75 -> exit 75") == 2
    assert out.count("training stopped with its state saved (exit 75); requeueing") == 2
    assert re.search(r"training failed with exit \d+ \(failure 1 of at most 2 requeued\); requeueing", out)
    assert len(re.findall(r"\[rank0 drafter\] dflash_dist.roles.drafter: resumed from", out)) == 3
    assert final_digest(run_dir) == final_digest(completed[2])


def worker_pid(job: int, rank: int) -> int | None:
    import psutil
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("SLURM_JOB_ID") == str(job) and env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
            return p.pid
    return None

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plain_scancel_saves_and_stays_cancelled(cluster, tmp_path):
    job, log, run_dir = run_job(cluster, tmp_path)
    before = training_started(run_dir)
    t0 = time.monotonic()
    cluster.signal(job)
    info, out = finish(cluster, job, log, 120)
    took = time.monotonic() - t0
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("CANCELLED", "0", "75:0"), out[-4000:]
    assert out.count("exit code 75: stopped on request with state saved") == 3
    assert "training step exited 75 while Slurm ends the job" in out and "requeueing" not in out
    assert max(steps_saved(run_dir)) > before, "the stop saved a checkpoint"
    assert took < 30, f"scancel -> job ended took {took:.1f}s: within KillWait"
    time.sleep(3)
    assert cluster.job(job)["JobState"] == "CANCELLED", "a cancelled job is never requeued"
    print(f"scancel -> CANCELLED with a checkpoint: {took:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_gpus_nproc_is_required(cluster, tmp_path):
    job, log, _ = run_job(cluster, tmp_path, env={"NPROC": ""})
    info, out = finish(cluster, job, log, 120)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0")
    assert "no GPUs in this allocation (SLURM_GPUS_ON_NODE is unset): set NPROC" in out
