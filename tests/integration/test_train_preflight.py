"""What a run finds before training, under torchrun (3 ranks, gloo), with exit 2 on every rank: nothing
to train, a run dir that cannot be written or is locked, a batch that cannot fit the device, a dataset
changed under a checkpoint, a read-only export directory, a bad train.eval_bench."""
import os
import re
import socket

import pytest
from helpers import exit_codes, read_only, torchrun

from dflash_dist.io.runlock import RunLock

pytestmark = pytest.mark.slow  # whole runs under torchrun


def _torchrun(overrides, run_dir):
    res = torchrun(3, ["train.epochs=1"] + overrides, run_dir, timeout=120)
    return res.returncode, res.stdout + res.stderr


def _every_rank_says(out, text):
    return all(re.search(rf"\[rank{r} \w+\] \S+: .*{re.escape(text)}", out) for r in range(3))


def test_nothing_to_train_is_exit_2_on_every_rank(tmp_path):
    rc, out = _torchrun(["plan.token_budget=19"], tmp_path / "run")  # every sample has 20+ tokens
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]
    assert _every_rank_says(out, "cannot start: nothing to train: epoch 1 of 1 has no batch: the plan skips 160 of "
                                 "160 samples: over_budget 160"), out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_dir_that_cannot_be_written_is_exit_2_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    rc, out = _torchrun([], tmp_path / "file" / "run")
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]
    assert _every_rank_says(out, "rank 0 (drafter) cannot start: config key 'train.run_dir': cannot create"), \
        out[-3000:]
    assert "went silent" not in out and "epoch 1" not in out


def test_a_second_run_on_a_locked_run_dir_is_exit_2(tmp_path):
    with RunLock(tmp_path):
        rc, out = _torchrun([], tmp_path)
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]
    assert _every_rank_says(out, f"is in use by another run (host {socket.gethostname()} pid {os.getpid()}"), \
        out[-3000:]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_a_batch_that_cannot_fit_the_device_is_refused_before_training(tmp_path):
    """The memory pre-flight with a device far too small (dist.device_memory_gib forces the check on CPU)."""
    res = torchrun(3, ["dist.device_memory_gib=0.001", "train.epochs=1"], tmp_path, timeout=120)
    out = res.stdout + res.stderr
    assert re.search(r"exitcode\s*:\s*2", out), out[-3000:]
    assert re.search(r"memory pre-flight: the drafter role needs [\d.]+ GiB at its worst batch .* but the device has "
                     r"0\.0 GiB", out), out[-3000:]
    assert "objective.anchor_chunk" in out or "plan.token_budget" in out
    assert not list(tmp_path.glob("checkpoints/step-*")) and not (tmp_path / "metrics.jsonl").exists()


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
    assert 2 in exit_codes(out), out[-3000:]
    assert "was trained on other data: the tokens changed (160 samples, as then), under the same data config" in out


def test_a_read_only_export_directory_is_exit_2_before_training(tmp_path):
    (tmp_path / "export").mkdir()
    with read_only(tmp_path / "export"):
        res = torchrun(3, ["train.epochs=1"], tmp_path)
    out = res.stdout + res.stderr
    assert 2 in exit_codes(out), out[-3000:]
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


def test_an_eval_bench_prompt_over_the_targets_context_is_exit_2_on_every_rank_before_training(tmp_path):
    """Prepared data, tau every 2 steps on train.eval_bench, whose line 2 fills the target's 64 positions:
    refused at start naming the file and line (as python -m dflash_dist.evaluate refuses it), not at the
    first tau measurement."""
    import json

    import torch
    import transformers

    from dflash_dist.config import load_config
    from dflash_dist.data.disk import write_dataset
    from dflash_dist.data.synthetic import synthetic_dataset
    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    model_dir = tmp_path / "target"
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**shape)).save_pretrained(model_dir)
    syn = load_config(None, ["data.synthetic.num_samples=48", "data.synthetic.min_len=20",
                             "data.synthetic.max_len=40"]).data.synthetic
    data = write_dataset(tmp_path / "prepared", synthetic_dataset(syn, shape["vocab_size"]))
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps([1, 2, 3]) + "\n" + json.dumps([5] * 70) + "\n")
    res = torchrun(3, ["model.target.kind=hf", f"model.target.path={model_dir}", "model.draft.target_layer_ids=[0,1,2]",
                       f"data.path={data}", "train.epochs=1", f"train.eval_bench={bench}", "train.eval_prompts=2",
                       "train.eval_every_steps=2"], tmp_path / "run", timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and re.search(r"exitcode\s*:\s*2", out), out[-3000:]
    assert _every_rank_says(out, "config key 'train.eval_bench': 1 prompt(s) of at least the target's context of 64 "
                                 f"positions, which it cannot answer: {bench}:2 (70 tokens)"), out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, keys", [
    (["variant.ce_weight=0", "variant.l1_weight=0", "variant.confidence_weight=0"],
     ["variant.ce_weight", "variant.l1_weight", "variant.confidence_weight"]),
    (["variant.enable_confidence_head=false", "variant.ce_weight=0", "variant.l1_weight=0"],
     ["variant.ce_weight", "variant.l1_weight"]),
])
def test_a_dspark_loss_that_trains_nothing_is_exit_2_before_any_group_forms(tmp_path, overrides, keys):
    """Issue 46, case 1: it was exit 0 with loss 0 at every step, a checkpoint and an export."""
    rc, out = _torchrun(["model.draft.variant=dspark", *overrides], tmp_path / "run")
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]
    assert all(f"'{k}'" in out for k in keys), out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "export").exists()
