"""The benchmarks that start processes: the transport bench between two spawned gloo ranks, and
gpu_check's dry run (every section, and a hung section ended so that the next one runs)."""
import json
import time

import psutil
import pytest
import torch

from dflash_dist.bench import gpu_check
from dflash_dist.bench import transport as bench_transport
from dflash_dist.models.variants import VARIANTS


def test_transport_bench_tiny(tmp_path, capsys):
    out = tmp_path / "transport.json"
    bench_transport.main(["--sizes", "0.25", "--real-tokens", "16", "--feat-dim", "256", "--reps", "2",
                          "--warmup", "1", "--json", str(out)])
    # The table is printed by the spawned rank 0, whose stdout is not captured here: read the JSON.
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["0.25 MiB", "real: 16 tok x 256"]
    for r in rows:
        assert r["packet_gib_s"] > 0 and r["raw_gib_s"] > 0 and r["packet/raw"] > 0
        assert len(r["packet_all_s"]) == len(r["raw_all_s"]) == 2
        # raw moves exactly the packet's bytes: header, meta (ids, mask, cu_seqlens) and bf16 features
        assert r["bytes"] == 8 * (8 + 2 * r["tokens"] + r["seqs"] + 1) + 2 * r["tokens"] * r["feat_dim"]


@pytest.mark.slow  # subprocesses and a torchrun job
def test_gpu_check_dry_run_reports_every_section(tmp_path, capsys):
    """Every section runs in its own process on CPU at tiny shapes (the nccl section: 2 gloo ranks) and
    reports its measurements; one table, one JSON file."""
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--dry-run", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    sections = json.loads(out.read_text())["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    for name, sec in sections.items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("log_tail"))
        assert f"\n{name} " in text  # its rows are in the table
    env, drafter, target, nccl = (sections[s]["values"] for s in ("env", "drafter", "target", "nccl"))
    assert env["torch"] == torch.__version__ and env["GPUs"] == 0 and env["C compiler"]
    assert drafter["attention path"] == "sdpa" and drafter["sdpa fallback fwd+bwd"] == "ok"
    assert drafter["mean step s"] > 0 and drafter["worst step s"] > 0
    anchors = {b: int(drafter[f"{b} batch"].split(", ")[2].split()[0]) for b in ("mean", "worst")}
    assert anchors["worst"] > anchors["mean"] > 0  # the plan's worst batch holds the most anchors
    assert drafter["graphs compiled after warm-up"] == 0
    assert target["tokens/s"] > 0 and target["isolation"] == "ok"
    # The end-to-end job ran the real entry point under torchrun (gloo, 2 colocated ranks, 2 epochs).
    assert nccl["colocated exit code"] == 0, sections["nccl"]
    assert nccl["colocated replicas identical"] == "2 of 2"
    assert nccl["colocated epochs"] == 2
    assert nccl["colocated watchdog/timeout lines"] == 0
    assert nccl["packet/raw"] > 0
    # The step's all-reduce under DDP, beside the same step with a flat all-reduce after it (2 gloo ranks).
    overlap = sections["overlap"]["values"]
    assert overlap["ranks"] == 2 and all(overlap[f"{case} s"] > 0 for case in ("compute", "serial", "ddp", "all-reduce"))
    # Every variant of the registry stepped at the drafter's shape, its seconds beside DFlash's.
    variants = sections["variants"]["values"]
    for name in VARIANTS:
        assert variants[f"{name} step s"] > 0 and variants[f"{name} step predicted s"] > 0, name
        assert name == "dflash" or variants[f"{name} / dflash step"] > 0, name


@pytest.mark.slow  # subprocesses and a torchrun job
def test_gpu_check_ends_a_hung_section_and_runs_the_next(tmp_path):
    """A section past its timeout is reported as timed out, its whole process tree ends (a child in a
    session of its own too, as torchrun's workers are), and the next section still runs."""
    out = tmp_path / "gpu.json"
    t0 = time.monotonic()
    assert gpu_check.main(["--dry-run", "--sections", "hang,env", "--timeouts", "hang=3",
                           "--json", str(out)]) == 0
    assert time.monotonic() - t0 < 40
    sections = json.loads(out.read_text())["sections"]
    hang, env = sections["hang"], sections["env"]
    assert hang["status"] == "timed out" and hang["error"] == "ended after 3 s"
    assert env["status"] == "ok" and env["values"]["torch"] == torch.__version__
    pids = [int(p) for p in hang["values"]["pids"].split()]
    assert len(pids) == 2
    for pid in pids:  # gone, or a zombie nobody reaps (init in a container may not)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
