"""Long samples under torchrun (3 ranks, gloo): a plan that would skip more than plan.max_skipped_share of
the supervised tokens, or a sample past the target's context, is exit 2 on every rank before training;
plan.long_samples=truncate trains every sample's first tokens and records the cut in summary.json."""
import json
import re

import numpy as np
import pytest
from helpers import torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun

# The TINY job's corpus (160 samples of 20-120 tokens), not regenerated: the lengths are known here.
JOB = ["train.epochs=1", "data.synthetic.regenerate=false"]


def _every_rank_says(out, text):
    return all(re.search(rf"\[rank{r} \w+\] \S+: .*{re.escape(text)}", out) for r in range(3))


def _lengths():
    from dflash_dist.config import load_config
    from dflash_dist.data.synthetic import synthetic_dataset
    cfg = load_config(None, ["data.synthetic.num_samples=160", "data.synthetic.min_len=20",
                             "data.synthetic.max_len=120"])
    return synthetic_dataset(cfg.data.synthetic, 128)


def test_a_plan_skipping_too_many_supervised_tokens_is_exit_2_naming_the_key(tmp_path):
    res = torchrun(3, JOB + ["plan.token_budget=64"], tmp_path / "run", timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and re.search(r"exitcode\s*:\s*2", out), out[-3000:]
    assert _every_rank_says(out, "config key 'plan.max_skipped_share': the plan skips "), out[-3000:]
    assert _every_rank_says(out, "plan.token_budget=120 keeps every sample"), out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_truncate_trains_every_samples_first_tokens_and_counts_the_cut(tmp_path):
    ds = _lengths()
    lengths, sup = ds.lengths, ds.num_supervised
    res = torchrun(3, JOB + ["plan.token_budget=64", "plan.long_samples=truncate"], tmp_path / "run", timeout=180)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["samples"] == 160 and s["tokens"] == int(np.minimum(lengths, 64).sum())  # cut in the batches too
    assert sum(s["skipped"].values()) == 0
    f = s["plan_facts"]
    assert f["long_samples"] == "truncate" and f["truncate_limit"] == 64
    assert f["truncated_samples"] == int((lengths > 64).sum()) > 0
    assert f["truncated_tokens"] == int((lengths - np.minimum(lengths, 64)).sum())
    assert f["supervised_tokens"] == int(sup.sum()) and f["skipped_supervised_tokens"] == 0
    assert all(np.isfinite(e["loss"]) for e in s["epochs"])


def _hf_target_of_64_positions(tmp_path):
    import torch
    import transformers

    from dflash_dist.data.disk import write_dataset
    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    model_dir = tmp_path / "target"
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**shape)).save_pretrained(model_dir)
    data = write_dataset(tmp_path / "prepared", _lengths())
    return ["model.target.kind=hf", f"model.target.path={model_dir}", "model.draft.target_layer_ids=[0,1,2]",
            f"data.path={data}", "train.epochs=1"], data


def test_samples_past_the_targets_context_are_exit_2_and_truncate_stops_at_it(tmp_path):
    """An hf target of 64 positions, samples of up to 120 tokens, plan.token_budget=1024: skip would train
    them past the target's positions (refused, naming the data and the target's config); truncate cuts
    them at min(1024, 64)."""
    job, data = _hf_target_of_64_positions(tmp_path)
    res = torchrun(3, job, tmp_path / "refused", timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and re.search(r"exitcode\s*:\s*2", out), out[-3000:]
    assert _every_rank_says(out, f"config key 'data.path={data}': "), out[-3000:]
    assert _every_rank_says(out, f"longer than the target's context (max_position_embeddings 64, "
                                 f"{tmp_path / 'target'}/config.json)"), out[-3000:]
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()

    res = torchrun(3, job + ["plan.long_samples=truncate"], tmp_path / "run", timeout=180)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    lengths = _lengths().lengths
    assert s["tokens"] == int(np.minimum(lengths, 64).sum()) and s["samples"] == 160
    assert s["plan_facts"]["truncate_limit"] == 64 and s["plan_facts"]["max_position_embeddings"] == 64
    assert s["plan_facts"]["truncated_samples"] == int((lengths > 64).sum())


def test_a_truncated_run_stopped_mid_epoch_resumes_exactly(tmp_path):
    """The cut is part of the plan, a pure function of (data, seed, epoch, budgets): SIGTERM mid-run, resume,
    and the weights are bitwise those of the uninterrupted run."""
    import signal

    import helpers
    job = ["train.epochs=2", "data.synthetic.regenerate=false", "data.synthetic.num_samples=400", "train.sync_every=2",
           "plan.token_budget=64", "plan.long_samples=truncate"]
    res = torchrun(3, job, tmp_path / "ref", timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    reference = helpers.final_digest(tmp_path / "ref")
    run = tmp_path / "run"
    run.mkdir()
    out, _, rc = helpers.interrupt(3, job, run, 6, lambda p: p.send_signal(signal.SIGTERM), 60)
    assert rc != 0 and "stopped on request" in out, out[-3000:]
    cursor = json.loads(sorted((run / "checkpoints").glob("step-*/meta.json"))[-1].read_text())["cursor"]
    assert (cursor["epoch"], cursor["batch"]) != (2, 0), "the stop must land mid-run"
    res = torchrun(3, job, run, timeout=240)
    assert res.returncode == 0 and "resumed from" in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    assert helpers.final_digest(run) == reference
    s = json.loads((run / "summary.json").read_text())
    assert s["plan_facts"]["truncated_samples"] > 0 and sum(s["skipped"].values()) == 0
