"""slurm/train.sbatch with a faked Slurm and launch/run.sh: syntax, the torchrun command per node, the
shutdown grace and allocator settings, signal -> requeue, and the grace torchrun really gives a worker."""
import pytest
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"
RUN = ROOT / "launch" / "run.sh"


def torchrun_args(line: str) -> tuple[dict, list[str]]:
    """A DRY_RUN line -> (the VAR=value words before the command, the command's words from torchrun on)."""
    words = line.split()
    at = next(i for i, w in enumerate(words) if w.endswith("torchrun"))
    return dict(w.split("=", 1) for w in words[:at]), words[at:]


def fake_slurm(tmp_path: Path, srun_body: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then printf "gpu-node-7\\ngpu-node-8\\n"; '
        f'else echo "$@" >> {tmp_path}/scontrol.log; fi\n')
    (bin_dir / "srun").write_text("#!/bin/bash\nwhile [[ \"$1\" == --* ]]; do shift; done\n" + srun_body)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[7-8]",
                SLURM_JOB_ID="123456", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(ROOT))


def test_scripts_parse():
    for script in [SBATCH, *sorted((ROOT / "launch").glob("*.sh"))]:
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_two_nodes_get_the_right_torchrun_arguments(tmp_path):
    env = fake_slurm(tmp_path, 'for n in 0 1; do SLURM_NODEID=$n DRY_RUN=1 "$@"; done\n')
    out = subprocess.run(["bash", str(SBATCH), "train.epochs=2"], env=env, capture_output=True, text=True,
                         timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stdout.splitlines() if "torchrun" in l]
    assert len(lines) == 2
    port = 20000 + 123456 % 20000
    for node, line in enumerate(lines):
        env, args = torchrun_args(line)
        assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        assert "--nnodes=2" in args and f"--node_rank={node}" in args and "--rdzv_backend=c10d" in args
        assert f"--rdzv_endpoint=gpu-node-7:{port}" in args and "--rdzv_id=123456" in args
        assert "--nproc_per_node=8" in args and "--max-restarts=2" in args and "--shutdown-timeout=300" in args
        assert args[-3:] == ["-m", "dflash_dist.train", "train.epochs=2"]
    assert "warning" not in out.stderr
    assert not (tmp_path / "scontrol.log").exists(), "a clean finish is not requeued"


def dry_run(**env) -> tuple[dict, list[str]]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "SHUTDOWN_TIMEOUT")}
    out = subprocess.run(["bash", str(RUN), "a=1"], env=dict(base, DRY_RUN="1", **env), capture_output=True,
                         text=True, check=True)
    return torchrun_args(out.stdout.strip())


def test_single_node_uses_standalone():
    _, args = dry_run(NPROC="4")
    assert args[1:3] == ["--standalone", "--nproc_per_node=4"]


def test_dry_run_shows_the_shutdown_grace_and_the_allocator_setting():
    env, args = dry_run()
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "--shutdown-timeout=300" in args
    # The user's allocator setting and grace period win over the defaults.
    env, args = dry_run(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512", SHUTDOWN_TIMEOUT="600")
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert "--shutdown-timeout=600" in args and "--shutdown-timeout=300" not in args


def test_signal_lead_time_covers_the_shutdown_grace(tmp_path):
    """Slurm's warning comes early enough for torchrun's grace plus a minute (the agents' exit, the
    requeue), and the script warns when a user's grace no longer fits."""
    text = SBATCH.read_text()
    lead = int(re.search(r"^#SBATCH --signal=B:USR2@(\d+)", text, re.M).group(1))
    assert int(re.search(r"^SIGNAL_LEAD_S=(\d+)$", text, re.M).group(1)) == lead
    default = int(re.search(r"SHUTDOWN_TIMEOUT=\$\{SHUTDOWN_TIMEOUT:-(\d+)\}", text).group(1))
    assert default == int(re.search(r"SHUTDOWN_TIMEOUT=\$\{SHUTDOWN_TIMEOUT:-(\d+)\}", RUN.read_text()).group(1))
    assert default + 60 <= lead
    env = fake_slurm(tmp_path, 'SLURM_NODEID=0 DRY_RUN=1 "$@"\n')
    out = subprocess.run(["bash", str(SBATCH)], env=dict(env, SHUTDOWN_TIMEOUT=str(lead)), capture_output=True,
                         text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 0 and "leaves under 60 s" in out.stderr
    assert f"--shutdown-timeout={lead}" in out.stdout


WORKER = """import os, signal, sys, time
from pathlib import Path
out = Path(os.environ["GRACE_DIR"])
def on_term(*_):  # as a rank does on a stop: finish the save, then exit with the resume-me code
    time.sleep(3)
    (out / "saved").write_text("ok")
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
(out / "ready").write_text(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset"))
while True:
    time.sleep(0.1)
"""


def stop_during_save(tmp_path: Path, grace: int) -> tuple[bool, str]:
    """launch/run.sh with torchrun's worker module swapped for WORKER; SIGTERM to the agent once the
    worker runs. Returns (whether the worker finished its 3-second save, the allocator setting it saw)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "grace_worker.py").write_text(WORKER)
    (bin_dir / "torchrun").write_text(  # the real torchrun, running the worker instead of the trainer
        '#!/bin/bash\nargs=()\nfor a in "$@"; do [ "$a" = dflash_dist.train ] && a=grace_worker; args+=("$a"); done\n'
        f'exec {Path(sys.executable).parent}/torchrun "${{args[@]}}"\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env.update(PYBIN=str(bin_dir), NPROC="1", SHUTDOWN_TIMEOUT=str(grace), GRACE_DIR=str(tmp_path),
               PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1")
    p = subprocess.Popen(["bash", str(RUN)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "ready").exists():
            assert time.monotonic() - t0 < 60 and p.poll() is None, "the worker never started"
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)  # run.sh exec'd torchrun: this is the agent
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return (tmp_path / "saved").exists(), (tmp_path / "ready").read_text()


@pytest.mark.slow  # a real torchrun
def test_torchrun_grace_lets_a_worker_finish_its_save(tmp_path):
    """The grace run.sh gives torchrun is what the installed torch honours: a 3-second save completes
    with a 20-second grace and is killed with a 1-second one."""
    (tmp_path / "long").mkdir()
    (tmp_path / "short").mkdir()
    saved, alloc = stop_during_save(tmp_path / "long", 20)
    assert saved and alloc == "expandable_segments:True"
    assert stop_during_save(tmp_path / "short", 1)[0] is False


def test_warning_signal_stops_the_step_and_requeues(tmp_path):
    # The fake step behaves like our ranks: on SIGTERM it "saves" and exits with the resume-me code.
    env = fake_slurm(tmp_path, f'trap "echo got-term > {tmp_path}/step.log; exit 75" TERM\n'
                               'for i in $(seq 200); do sleep 0.1; done\nexit 0\n')
    p = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, cwd=tmp_path)
    time.sleep(1.5)
    p.send_signal(signal.SIGUSR2)  # what --signal=B:USR2@300 delivers
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 75, out
    assert (tmp_path / "step.log").read_text().strip() == "got-term"
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "123456"]
