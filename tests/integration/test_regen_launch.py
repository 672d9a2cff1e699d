"""Regeneration as real processes under faults: a dead rank on another node (two torchrun agents) ends
rank 0 with exit 3 naming it; launch/run.sh and slurm/regenerate.sbatch refuse a bad NPROC or
TENSOR_PARALLEL before torchrun."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_for
from regen_fixtures import (
    ENV,
    ROOT,
    fault_argv,
    target,  # noqa: F401  (fixtures)
)
from torch.distributed import TCPStore

from dflash_dist.bench.regenerate import conversations, write_jsonl
from dflash_dist.data.regen import chunks


def regen_workers(root_pid: int) -> dict[int, int]:
    """{RANK: pid} of the regeneration workers below `root_pid` (from their environment)."""
    from dflash_dist.data.regen.reaper import descendants
    out = {}
    for pid in descendants(root_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"dflash_dist.data.regenerate" in cmd and b"torch.distributed" not in cmd and b"RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


@pytest.mark.slow
def test_a_dead_rank_on_another_node_ends_rank_0_with_exit_3_naming_it(target, tmp_path):
    """Two torchrun agents (--nnodes=2, c10d rendezvous on loopback), one rank each: SIGKILL of the rank on
    the second node; the other rank (rank 0 here as a rule: the first agent's) names it and exits 3 within
    --dead-after-s and a margin (rank 0 used to poll for the dead rank's chunks forever). The rendezvous
    store is the test's own, listening before either agent starts (each agent's attempt to host it falls
    back to joining it): no port is chosen, released and bound later."""
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(200, seed=9))
    out = tmp_path / "out.jsonl"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    env = dict(ENV, MODULE="dflash_dist.data.regenerate", KEEP_CWD="1", PYBIN=str(Path(sys.executable).parent),
               NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID=f"faults-{port}",
               SHUTDOWN_TIMEOUT="10")
    cmd = ["bash", str(ROOT / "launch" / "run.sh"),
           *fault_argv(target, src, out, "--batch-size", "1", "--dead-after-s", "5", "--heartbeat-s", "0.5")]
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]
    nodes = []
    try:
        for n in (0, 1):  # the first agent joins first: its rank is 0 (ranks follow the agents' pids)
            nodes.append(subprocess.Popen(cmd, env=dict(env, NODE_RANK=str(n)), stdout=logs[n],
                                          stderr=subprocess.STDOUT, start_new_session=True))
            if n == 0:
                wait_for(lambda: store.check([f"torch.rendezvous.faults-{port}"]), 60, "the first agent's rendezvous")
        ranks = {}
        wait_for(lambda: ranks.update({(n, r): p for n in (0, 1) for r, p in regen_workers(nodes[n].pid).items()})
                 or len(ranks) == 2, 120, "both ranks")
        # Node 1's rank dies (the survivor still needs the store to name it: the test holds it).
        (_, victim_rank), = [k for k in ranks if k[0] == 1]
        wait_for(lambda: all((chunks.parts_dir(out) / f"progress-rank{r}.json").exists() for r in (0, 1)), 180,
                 "both ranks at work")
        os.kill(ranks[(1, victim_rank)], signal.SIGKILL)
        t0 = time.monotonic()
        code = nodes[0].wait(timeout=60)
        took = time.monotonic() - t0
        nodes[1].wait(timeout=60)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = (tmp_path / "node0.log").read_text()
    assert code == 3, text[-3000:]
    assert re.search(rf"rank {victim_rank} \(regeneration\) went silent: no heartbeat for [\d.]+s "
                     r"\(--dead-after-s=5\)", text), text[-3000:]
    assert "local ranks' exit codes: 3 -> exit 3" in text
    print(f"rank {1 - victim_rank} out {took:.1f} s after the SIGKILL of rank {victim_rank} (--dead-after-s 5)")
    assert not out.exists()


@pytest.mark.parametrize("nproc", ["0", "-1", "auto", "cpu", "gpu", "2x"])
def test_run_sh_refuses_a_bad_nproc_before_torchrun(tmp_path, nproc):
    res = subprocess.run(["bash", str(ROOT / "launch" / "run.sh")], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, NPROC=nproc, PYBIN=str(tmp_path)))  # no torchrun there
    assert res.returncode == 2 and f"NPROC={nproc}: must be a whole number" in res.stderr, res.stderr


@pytest.mark.parametrize("tp, gpus", [("16", "8"), ("0", "8"), ("two", "8")])
def test_regenerate_sbatch_refuses_an_impossible_tensor_parallel(tmp_path, tp, gpus):
    res = subprocess.run(["bash", str(ROOT / "slurm" / "regenerate.sbatch")], capture_output=True, text=True,
                         timeout=30, cwd=tmp_path, env=dict(os.environ, DFLASH_ROOT=str(ROOT), TENSOR_PARALLEL=tp,
                                                            SLURM_GPUS_ON_NODE=gpus, SLURM_SUBMIT_DIR=str(tmp_path)))
    assert res.returncode == 2 and f"TENSOR_PARALLEL={tp}" in res.stderr, res.stderr
