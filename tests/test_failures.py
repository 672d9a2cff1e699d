"""Failures that used to be silent, under torchrun (3 ranks, gloo): divergence, a finished run restarted,
batches that cannot hold an anchor."""
import json
import re

import pytest
import torch

from helpers import torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them


def test_a_diverging_run_stops_with_exit_4_and_writes_no_nonfinite_state(tmp_path):
    res = torchrun(3, ["optim.lr=1e30", "train.epochs=1", "train.max_nonfinite_steps=3"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert re.search(r"exitcode\s*:\s*4", out), out[-3000:]
    assert len(re.findall(r"step \d+ skipped: loss sum \S+, gradient norm \S+ \(\d of at most 3", out)) == 3, out[-3000:]
    assert "training diverged: 3 steps with a non-finite loss or gradient norm" in out
    assert not (tmp_path / "export").exists() and not list((tmp_path / "checkpoints").glob("step-*"))
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "diverged" and last["skipped_steps"] == 3 and last["grad_norm"] is None  # NaN -> null


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


def test_samples_shorter_than_a_block_are_all_trained(tmp_path):
    """400 samples of 8-30 tokens at B = 16 (the old rule skipped about half as no_anchor)."""
    res = torchrun(3, ["train.epochs=1", "data.synthetic.num_samples=400", "data.synthetic.min_len=8",
                       "data.synthetic.max_len=30", "objective.block_size=16"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped"] == {"empty": 0, "no_supervised": 0, "no_anchor": 0, "over_budget": 0}, summary["skipped"]
    assert summary["samples"] == 400, "every sample trained"
    assert all(torch.isfinite(torch.tensor(summary["acc_per_position"])))


def test_a_batch_that_cannot_fit_the_device_is_refused_before_training(tmp_path):
    """The memory pre-flight with a device far too small (dist.device_memory_gib forces the check on CPU)."""
    res = torchrun(3, ["dist.device_memory_gib=0.001", "train.epochs=1"], tmp_path, timeout=120)
    out = res.stdout + res.stderr
    assert re.search(r"exitcode\s*:\s*2", out), out[-3000:]
    assert re.search(r"memory pre-flight: the drafter role needs [\d.]+ GiB at its worst batch .* but the device has "
                     r"0\.0 GiB", out), out[-3000:]
    assert "objective.anchor_chunk" in out or "plan.token_budget" in out
    assert not list(tmp_path.glob("checkpoints/step-*")) and not (tmp_path / "metrics.jsonl").exists()
