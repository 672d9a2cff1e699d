"""A one-node Slurm cluster for the tests (launch/slurm_local.sh): start, submit slurm/train.sbatch, read
a job's state from scontrol (there is no accounting database), stop."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "launch" / "slurm_local.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"
# A CPU-only node: the script's header asks for 8 GPUs and 64 CPUs per node on 2 nodes.
CPU_ONLY = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"]


class SlurmCluster:
    # Shorter than Slurm's defaults (cred_expire 120 s, sched_interval 60 s) so a requeued job starts
    # again within seconds; KillWait stays Slurm's default, 30 s.
    SETTINGS = {"CRED_EXPIRE": "5", "SCHED_INTERVAL": "1", "KILL_WAIT": "30"}

    def __init__(self, workdir: Path):
        self.dir = workdir
        self.env = dict(os.environ, **self.SETTINGS)
        subprocess.run(["bash", str(LOCAL), "start", str(workdir)], env=self.env, check=True, timeout=600,
                       stdout=subprocess.DEVNULL)
        self.env["SLURM_CONF"] = str(workdir / "slurm.conf")

    def stop(self) -> None:
        subprocess.run(["bash", str(LOCAL), "stop", str(self.dir)], timeout=60)

    def run(self, *args: str) -> str:
        return subprocess.run(list(args), env=self.env, check=True, capture_output=True, text=True,
                              timeout=30).stdout

    def submit(self, train_args: list[str], sbatch_opts: list[str], cwd: Path, env: dict | None = None) -> int:
        """sbatch the real script from `cwd` (any directory), as a CPU-only job."""
        e = {k: v for k, v in self.env.items() if k != "DFLASH_ROOT"}
        e.update(env or {})
        out = subprocess.run(["sbatch", "--parsable", *CPU_ONLY, *sbatch_opts, str(SBATCH), *train_args],
                             env=e, cwd=cwd, check=True, capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """scontrol's record of the job: JobState, Restarts, ExitCode, Comment, ..."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        end = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in states:
                return info
            assert time.monotonic() < end, f"job {job_id} still {info['JobState']} after {timeout}s\n{self.log()}"
            time.sleep(0.5)

    def signal(self, job_id: int, *opts: str) -> None:
        self.run("scancel", *opts, str(job_id))

    def log(self) -> str:
        """The end of the daemons' logs, for a failing test's message."""
        return "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted((self.dir / "log").glob("*.log")))
