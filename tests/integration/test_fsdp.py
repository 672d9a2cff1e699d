"""FSDP2 drafters (roles.drafter_sharding=fsdp) under torchrun: 2 drafters + 2 targets, gloo on CPU."""
import json
import re
import signal

import pytest
import torch
from helpers import final_digest, interrupt, torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them

JOB = ["roles.drafters_per_node=2", "train.epochs=2", "objective.anchor_chunk=3", "train.sync_every=2",
       "data.synthetic.num_samples=400"]


def last_weights(run_dir):
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "drafter.pt"
    return torch.load(ckpt, map_location="cpu", weights_only=False)["drafter"]


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp")
    res = torchrun(4, JOB + ["roles.drafter_sharding=fsdp"], run_dir)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    return run_dir, final_digest(run_dir), out


def test_fsdp_drafters_train_like_ddp_drafters(tmp_path, fsdp_reference):
    fsdp_dir, _, _ = fsdp_reference
    tails = [e["tail_idle_drafters"] for e in json.loads((fsdp_dir / "summary.json").read_text())["epochs"]]
    assert tails and all(idle in (0, 1) for idle in tails), tails  # 2 drafters: the last step has 1 or 2
    res = torchrun(4, JOB, tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    ddp, fsdp = last_weights(tmp_path), last_weights(fsdp_dir)
    assert ddp.keys() == fsdp.keys()
    for k in ddp:  # same plan, anchors and math; only the reduction order differs
        torch.testing.assert_close(fsdp[k], ddp[k], rtol=2e-4, atol=2e-5, msg=k)
    # The exports hold the same tensors (names, shapes; values within the same tolerance).
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "export" / "model.safetensors"), load_file(fsdp_dir / "export" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2e-2, atol=1e-3, msg=k)


def test_fsdp_stop_and_resume_is_exact(tmp_path, fsdp_reference):
    _, reference, _ = fsdp_reference
    first, _, _ = interrupt(4, JOB + ["roles.drafter_sharding=fsdp"], tmp_path, 3,
                            lambda p: p.send_signal(signal.SIGTERM), 60)
    assert len(re.findall(r"exit code 75: stopped on request", first)) == 4, first[-3000:]
    res = torchrun(4, JOB + ["roles.drafter_sharding=fsdp"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "resumed from" in out, out[-3000:]
    assert final_digest(tmp_path) == reference


def test_a_ddp_checkpoint_resumes_under_fsdp(tmp_path):
    """Checkpoints hold whole state dicts in both modes: a DDP run stopped mid-run finishes under FSDP."""
    first, _, _ = interrupt(4, JOB, tmp_path, 3, lambda p: p.send_signal(signal.SIGTERM), 60)
    assert len(re.findall(r"exit code 75: stopped on request", first)) == 4, first[-3000:]
    res = torchrun(4, JOB + ["roles.drafter_sharding=fsdp"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "resumed from" in out, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["samples"] == 2 * (400 - sum(summary["skipped"].values()))
