"""slurm/train.sbatch with a faked Slurm: syntax, the torchrun command per node, signal -> requeue."""
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"


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


def test_sbatch_parses():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_two_nodes_get_the_right_torchrun_arguments(tmp_path):
    env = fake_slurm(tmp_path, 'for n in 0 1; do SLURM_NODEID=$n DRY_RUN=1 "$@"; done\n')
    out = subprocess.run(["bash", str(SBATCH), "train.epochs=2"], env=env, capture_output=True, text=True,
                         timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stdout.splitlines() if "torchrun" in l]
    assert len(lines) == 2
    port = 20000 + 123456 % 20000
    for node, line in enumerate(lines):
        args = line.split()
        assert args[0].endswith("torchrun")
        assert "--nnodes=2" in args and f"--node_rank={node}" in args and "--rdzv_backend=c10d" in args
        assert f"--rdzv_endpoint=gpu-node-7:{port}" in args and "--rdzv_id=123456" in args
        assert "--nproc_per_node=8" in args and "--max-restarts=2" in args
        assert args[-3:] == ["-m", "dflash_dist.train", "train.epochs=2"]
    assert not (tmp_path / "scontrol.log").exists(), "a clean finish is not requeued"


def test_single_node_uses_standalone():
    env = dict(os.environ, DRY_RUN="1", NPROC="4")
    out = subprocess.run(["bash", str(ROOT / "launch" / "run.sh"), "a=1"], env=env, capture_output=True, text=True)
    assert out.stdout.split()[1:3] == ["--standalone", "--nproc_per_node=4"]


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
