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


# -- issue 19: diverged checkpoints, roll-backs and requeues, changed data, a read-only export ---------------------

def _exit(out):
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)}
    return codes


def test_periodic_checkpoints_of_a_diverging_run_keep_no_exploded_weights_and_the_way_out_works(tmp_path):
    job = ["train.epochs=1", "train.checkpoint_every_steps=1", "train.keep_last=2"]
    res = torchrun(3, job + ["optim.lr=1e30"], tmp_path)
    out = res.stdout + res.stderr
    assert 4 in _exit(out), out[-3000:]
    assert "no checkpoint of this run is known to be good: start over with train.resume=none and a lower optim.lr" \
        in out, out[-3000:]
    assert not list((tmp_path / "checkpoints").glob("step-*")), "nothing auto could resume into the divergence"
    (aside,) = (tmp_path / "checkpoints" / "set-aside").glob("diverged-*")
    (exploded,) = aside.glob("step-*")  # written after the one finite step, whose weights then gave NaN
    assert max(v.abs().max() for v in torch.load(exploded / "drafter.pt")["drafter"].values()) > 1e20
    res = torchrun(3, job + ["optim.lr=1e-2"], tmp_path)  # the same command with a sane lr (auto)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_nonfinite_steps"] == 0


def test_a_run_that_skips_most_of_its_steps_is_diverged_and_exports_nothing(tmp_path):
    res = torchrun(3, ["optim.lr=1e30", "train.epochs=1", "train.max_nonfinite_steps=1000"], tmp_path)
    out = res.stdout + res.stderr
    assert 4 in _exit(out), out[-3000:]
    assert re.search(r"training diverged: the last step \(12\) was skipped for a non-finite loss or gradient norm "
                     r"\(11 of 12 steps skipped; the last finite one was step 1\)", out), out[-3000:]
    assert not (tmp_path / "export").exists() and not (tmp_path / "summary.json").exists()
    assert not list((tmp_path / "checkpoints").glob("step-*"))


def test_a_roll_back_survives_requeues_with_auto_or_the_same_path(tmp_path):
    job = ["train.epochs=1", "train.checkpoint_every_steps=4", "train.keep_last=0"]
    res = torchrun(3, job, tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    first = json.loads((tmp_path / "summary.json").read_text())
    back = tmp_path / "checkpoints" / "step-00000004"
    res = torchrun(3, job + [f"train.resume={back}"], tmp_path)  # roll back to step 4 and train on from there
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "moved to" in out and "resumed from" in out
    (aside,) = (tmp_path / "checkpoints" / "set-aside").glob("rolled-back-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000008", "step-00000012"]
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["weights_digest"] == first["weights_digest"]  # the same steps from step 4: the same weights
    for requeue in (job + [f"train.resume={back}"], job):  # the same command line again, then auto
        res = torchrun(3, requeue, tmp_path)
        out = res.stdout + res.stderr
        assert res.returncode == 0 and "nothing to do" in out, out[-3000:]  # never from step 4 a second time
        assert "resumed from" not in out


def test_a_dataset_changed_under_a_checkpoint_is_exit_2_naming_the_change(tmp_path):
    import numpy as np

    from dflash_dist.config import load_config
    from dflash_dist.data.disk import write_dataset
    from dflash_dist.data.synthetic import synthetic_dataset
    ds = synthetic_dataset(load_config(None, ["data.synthetic.num_samples=160", "data.synthetic.max_len=120",
                                              "data.synthetic.min_len=20"]).data.synthetic, 128)
    write_dataset(tmp_path / "data", ds)
    job = ["train.epochs=1", f"data.path={tmp_path / 'data'}"]
    res = torchrun(3, job, tmp_path / "run")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    shuffled = np.random.default_rng(0).permutation(np.asarray(ds.tokens))  # same lengths and mask, new tokens
    write_dataset(tmp_path / "data", type(ds)(shuffled, ds.offsets, ds.loss_mask, ds.vocab_size), overwrite=True)
    res = torchrun(3, job, tmp_path / "run")
    out = res.stdout + res.stderr
    assert 2 in _exit(out), out[-3000:]
    assert "was trained on other data: the tokens changed (160 samples, as then), under the same data config" in out


def test_a_read_only_export_directory_is_exit_2_before_training(tmp_path):
    import os
    import subprocess
    (tmp_path / "export").mkdir()
    # root ignores permission bits: make the directory immutable instead (ext4/xfs; chattr +i).
    lock, unlock = (["chattr", "+i"], ["chattr", "-i"]) if os.geteuid() == 0 else (["chmod", "555"], ["chmod", "755"])
    subprocess.run(lock + [str(tmp_path / "export")], check=True)
    try:
        res = torchrun(3, ["train.epochs=1"], tmp_path)
    finally:
        subprocess.run(unlock + [str(tmp_path / "export")], check=True)
    out = res.stdout + res.stderr
    assert 2 in _exit(out), out[-3000:]
    assert re.search(r"config key 'train.run_dir': \S+/export is not writable: (Operation not permitted|Permission "
                     r"denied)", out), out[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_bad_eval_bench_is_exit_2_on_every_rank_before_training(tmp_path):
    """A prompt set that cannot be read is found on rank 0 before any rank waits (not at the first tau)."""
    bench = tmp_path / "bench.jsonl"
    bench.write_text('{"turns": ["hi"]}\n{"turns": \n')
    res = torchrun(3, ["train.epochs=1", "train.eval_prompts=2", f"train.eval_bench={bench}"], tmp_path / "run",
                   timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and re.search(r"exitcode\s*:\s*2", out), out[-3000:]
    for r in range(3):
        assert re.search(rf"\[rank{r} \w+\] .*config key 'train.eval_bench': .*bench.jsonl", out), (r, out[-3000:])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
