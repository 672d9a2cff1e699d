"""launch/run.sh and the sbatch scripts without Slurm: run.sh's exit code from its workers' (and exit 75
after a saved stop), the torchrun command per node (two nodes through a fake srun: one machine cannot be
two nodes), the shutdown grace torchrun really gives a worker, the scripts parse."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
from helpers import wait_for
from slurm_cluster import SBATCH

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "launch" / "run.sh"


def steps_saved(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*[0-9]"))


def torchrun_args(line: str) -> tuple[dict, list[str]]:
    """A DRY_RUN line -> (the VAR=value words before the command, the command's words from torchrun on)."""
    words = line.split()
    at = next(i for i, w in enumerate(words) if w.endswith("torchrun"))
    return dict(w.split("=", 1) for w in words[:at]), words[at:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_sh_exits_75_after_a_saved_stop(tmp_path):
    """SIGUSR2 to run.sh's process group (run.sh and the torchrun agent, which must survive it): run.sh
    passes SIGTERM to the agent, the workers save and exit 75, and so does run.sh, though torchrun exits 1."""
    run_dir = tmp_path / "run"
    overrides = ["train.epochs=2", "data.synthetic.num_samples=400", "train.checkpoint_every_steps=10"]
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        p = subprocess.Popen(["bash", str(RUN), *helpers.TINY, *overrides, f"train.run_dir={run_dir}"], stdout=f,
                             stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             start_new_session=True)
    try:
        wait_for(lambda: (run_dir / "checkpoints").exists() and steps_saved(run_dir), 120, "a checkpoint")
        os.killpg(p.pid, signal.SIGUSR2)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 75, out[-3000:]
    assert "torchrun exited 1; local ranks' exit codes: 75 75 75 -> exit 75" in out
    assert out.count("exit code 75: stopped on request with state saved") == 3


FAKE_TORCHRUN = """#!/bin/bash
# Writes the local ranks' codes given in FAKE_CODES ("-" = none, as a killed worker) and exits FAKE_RC.
r=0
for c in $FAKE_CODES; do
  [ "$c" != - ] && echo "$c" > "$DFLASH_EXIT_CODE_DIR/local-rank-$r"
  r=$((r + 1))
done
exit $FAKE_RC
"""


@pytest.mark.parametrize("codes, torchrun_rc, expected", [
    ("75 75 75", 1, 75),  # a saved stop: torchrun exits 1 after the signal
    ("0 0 0", 0, 0),
    ("2 2 2", 1, 2),
    ("0 75 75", 1, 75),  # ranks that had finished (regeneration's chunks) beside stopped ones: resumable
    ("75 75 -", 1, 1),  # one worker killed: not a saved stop
    ("3 - 3", 1, 3),  # a peer died
    ("- - -", 0, 1),  # no worker said anything: never a success
    ("- - -", 137, 137),
])
def test_run_sh_exit_code_comes_from_the_workers(tmp_path, codes, torchrun_rc, expected):
    (tmp_path / "torchrun").write_text(FAKE_TORCHRUN)
    (tmp_path / "torchrun").chmod(0o755)
    out = subprocess.run(["bash", str(RUN)], env=dict(os.environ, PYBIN=str(tmp_path), FAKE_CODES=codes,
                                                     FAKE_RC=str(torchrun_rc), NPROC="3"),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == expected, out.stderr
    assert f"torchrun exited {torchrun_rc}; local ranks' exit codes: {codes.replace('-', 'none')} -> exit {expected}" \
        in out.stderr


def fake_slurm(tmp_path: Path, srun_body: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then printf "gpu-node-7\\ngpu-node-8\\n"; '
        f'elif [ "$1 $2" = "show job" ]; then echo "   Command={SBATCH} train.epochs=2"; '
        f'else echo "$@" >> {tmp_path}/scontrol.log; fi\n')
    (bin_dir / "srun").write_text("#!/bin/bash\nwhile [[ \"$1\" == --* ]]; do shift; done\n" + srun_body)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "DFLASH_ROOT")}
    return dict(env, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[7-8]",
                SLURM_JOB_ID="123456", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(tmp_path))


def test_scripts_parse():
    for script in [*sorted((ROOT / "slurm").iterdir()), *sorted((ROOT / "launch").glob("*.sh"))]:
        subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("nproc", [None, "4"])
def test_two_nodes_get_the_right_torchrun_arguments(tmp_path, nproc):
    """Per node: c10d rendezvous on the first node, one worker per GPU unless NPROC says otherwise, no
    torchrun restarts; run from a copy of the script outside the repository (as sbatch does)."""
    env = fake_slurm(tmp_path, 'for n in 0 1; do SLURM_NODEID=$n DRY_RUN=1 "$@"; done\n')
    if nproc:
        env["NPROC"] = nproc
    copy = tmp_path / "slurm_script"  # slurmd runs a copy from its spool directory
    copy.write_text(SBATCH.read_text())
    out = subprocess.run(["bash", str(copy), "train.epochs=2"], env=env, capture_output=True, text=True,
                         timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "torchrun" in line]
    assert len(lines) == 2
    port = 20000 + 123456 % 20000
    for node, line in enumerate(lines):
        env_words, args = torchrun_args(line)
        assert env_words == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        assert "--nnodes=2" in args and f"--node_rank={node}" in args and "--rdzv_backend=c10d" in args
        assert f"--rdzv_endpoint=gpu-node-7:{port}" in args and "--rdzv_id=123456" in args
        assert f"--nproc_per_node={nproc or 8}" in args and "--max-restarts=0" in args
        assert "--shutdown-timeout=300" in args
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
    assert args[1:4] == ["--standalone", "--nproc_per_node=4", "--max-restarts=0"]


def test_torchrun_restarts_are_refused():
    out = subprocess.run(["bash", str(RUN)], env=dict(os.environ, MAX_RESTARTS="2", DRY_RUN="1"),
                         capture_output=True, text=True)
    assert out.returncode == 2 and "MAX_RESTARTS=2 is not supported" in out.stderr


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
    lead = int(re.search(r"^#SBATCH --signal=USR2@(\d+)", text, re.M).group(1))
    assert int(re.search(r"^SIGNAL_LEAD_S=(\d+)\b", text, re.M).group(1)) == lead
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
    """launch/run.sh with torchrun's worker module swapped for WORKER; SIGTERM to run.sh once the
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
        p.send_signal(signal.SIGTERM)  # run.sh passes it to the torchrun agent
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
