"""tau measured during training under torchrun: every train.eval_every_steps steps on prepared data
(metrics, summary and model card), and the end-of-run tau on a train.eval_bench file."""
import json
import re

import numpy as np
import pytest
import transformers  # the `hf` extra; `dev` (what the tests install) includes it
from evaluate_fixtures import write_jsonl
from helpers import metrics, torchrun

# The token-id prompts of tests/system/test_evaluate_engines.py.
IDS = [[3, 17, 42, 99, 5, 8, 60], [11, 22, 23, 7, 90, 31, 44, 12, 19, 64, 1, 77], [120, 5, 6],
       [40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.mark.slow
def test_tau_every_n_steps_on_prepared_data_reaches_metrics_summary_and_card(tmp_path):
    model_dir, data, bench = _prepared(tmp_path)
    run_dir = tmp_path / "run"
    res = torchrun(3, ["model.target.kind=hf", f"model.target.path={model_dir}", "model.draft.target_layer_ids=[0,1,2]",
                       f"data.path={data}", "roles.drafters_per_node=2", "train.epochs=2",
                       f"train.eval_bench={bench}", "train.eval_prompts=3", "train.eval_new_tokens=6",
                       "train.eval_every_steps=2", "monitor.interval_s=0.05"], run_dir, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # Rank 0 decodes with the whole target; the other drafter holds only the embedding and LM head.
    assert re.search(r"\[rank1 drafter\] dflash_dist.models.head: drafter head from", out), out[-3000:]
    assert not re.search(r"\[rank0 drafter\] dflash_dist.models.head: drafter head from", out), out[-3000:]
    recs = metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    taus = [r for r in recs if r.get("kind") == "tau"]
    steps = summary["steps"]
    want = [0] + list(range(2, steps, 2)) + [steps]
    assert [r["step"] for r in taus] == want, (taus, steps)
    assert all(r["prompt_set"] == "heldout" and r["num_prompts"] == 3 and r["tau"] >= 1.0 for r in taus)
    assert [t["step"] for t in summary["tau_during_training"]] == want
    assert summary["tau_trained"]["tau"] == taus[-1]["tau"] and summary["tau_untrained"]["step"] == 0
    # The monitor's records (the figures of its line) carry the last measurement, by its step.
    measured = {t["step"]: t["tau"] for t in taus}
    progress = [r for r in recs if r.get("kind", "progress") == "progress" and "tau_step" in r]
    assert any(r["tau_step"] >= 1 for r in progress), progress
    assert all(measured[r["tau_step"]] == r["tau"] for r in progress)
    card = (run_dir / "export" / "README.md").read_text()
    assert f"| tau at the end of training | {taus[-1]['tau']:.3f} on heldout |" in card
    # final_*: the last epoch's means, not the last step's figures.
    assert summary["final_window"] == f"mean of epoch 2 ({summary['epochs'][-1]['steps']} steps)"
    assert summary["final_loss"] == summary["epochs"][-1]["loss"] != summary["last_step_loss"]


@pytest.mark.slow  # a whole run under torchrun
def test_training_summary_tau_on_eval_bench(tmp_path):
    """train.eval_bench: the run's own tau before and after training comes from that prompt set."""
    bench = write_jsonl(tmp_path / "mine.jsonl", IDS)
    res = torchrun(2, ["train.epochs=1", "data.synthetic.regenerate=false", "train.eval_prompts=3",
                       "train.eval_new_tokens=12", f"train.eval_bench={bench}"], tmp_path / "run", timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("tau_untrained", "tau_trained"):
        r = summary[key]
        assert r["prompt_set"] == "mine" and r["num_prompts"] == 3 and r["exact"] and r["tau"] >= 1.0, r
        assert r["num_steps"] >= 3  # 12 new tokens per prompt, at most a block (16) per step


def _prepared(tmp_path):
    import torch

    from dflash_dist.config import load_config
    from dflash_dist.data.disk import write_dataset
    from dflash_dist.data.synthetic import synthetic_dataset
    torch.manual_seed(0)
    model_dir = tmp_path / "target"
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**SHAPE)).save_pretrained(model_dir)
    syn = load_config(None, ["data.synthetic.num_samples=96", "data.synthetic.min_len=20",
                             "data.synthetic.max_len=80"]).data.synthetic
    data = write_dataset(tmp_path / "prepared", synthetic_dataset(syn, SHAPE["vocab_size"]))
    bench = tmp_path / "heldout.jsonl"
    rng = np.random.default_rng(1)
    bench.write_text("".join(json.dumps(rng.integers(0, 128, 10).tolist()) + "\n" for _ in range(3)))
    return model_dir, data, bench


SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
