"""Run a whole training job under torchrun from a benchmark and read back its summary; a benchmark's
result files: probed before its work (`check_outputs`), written atomically (`write_json`)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_dist.io.files import OutputPathError, atomic_write, check_output_dir, check_output_path


def run_job(nproc: int, overrides: list[str], timeout: float = 900) -> dict:
    """Launch `torchrun -m dflash_dist.train` on this machine; returns summary.json plus wall time."""
    run_dir = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dflash_dist.train", "wandb.mode=disabled", "train.resume=none", "train.export=false",
           # Speed does not depend on what the tokens say: no corpus regeneration, no tau evaluation.
           "data.synthetic.regenerate=false", "train.eval_prompts=0",
           f"train.run_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"job failed ({' '.join(overrides)}):\n{(res.stdout + res.stderr)[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["wall_s"] = wall
    return summary


def check_outputs(ap: argparse.ArgumentParser, args: argparse.Namespace, files: tuple[str, ...] = ("--json",),
                  dirs: tuple[str, ...] = ()) -> None:
    """Every result file (`files`) and scratch folder (`dirs`) a benchmark writes, named by its flag,
    probed before any work (`io.files.check_output_path`: a file created and removed there, a
    missing folder made): one that cannot be written is argparse's usage error naming the flag, exit 2,
    instead of a traceback that loses the measurement at the end. An empty value (no output) passes."""
    for flag in (*files, *dirs):
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if not path:
            continue
        try:
            if flag in dirs:
                check_output_dir(path, flag)
            else:
                check_output_path(path, flag, make_parents=True)
        except OutputPathError as exc:
            ap.error(str(exc))


def write_json(path: str, payload: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, json.dumps(payload, indent=2) + "\n")
