"""A tiny random transformers Qwen3 saved to a local directory: train (3 ranks), export, evaluate."""
import json
import re
import subprocess
import sys

import pytest
import transformers  # the `hf` extra; `dev` (what the tests install) includes it
from helpers import final_digest, torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them


SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


def save_tiny(model_dir, moe=False):
    import torch
    cfg = transformers.Qwen3MoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2) \
        if moe else transformers.Qwen3Config(**SHAPE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)


@pytest.mark.parametrize("nproc, tp, moe", [(3, 1, False), (5, 2, False), (5, 2, True)])
def test_hf_target_trains_exports_and_evaluates(tmp_path, nproc, tp, moe):
    """1 drafter and 2 target replicas of `tp` ranks each; with tp=2 every replica is sharded."""
    model_dir = tmp_path / "target"
    save_tiny(model_dir, moe)
    target = ["model.target.kind=hf", f"model.target.path={model_dir}", "model.draft.target_layer_ids=[0,1,2]"]
    run_dir = tmp_path / "run"
    res = torchrun(nproc, target + ["train.epochs=1", "data.synthetic.regenerate=false",
                                    f"model.target.tensor_parallel={tp}"], run_dir, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    if tp > 1:  # only the replicas' first ranks send; the drafter never held the decoder layers
        assert "layout: 1 nodes x 5 ranks, 1 drafters [0], 4 targets [1, 2, 3, 4]" in out, out[-3000:]
        assert re.search(r"\[rank2 target\] \S+: done: 0 packets sent", out) and \
            re.search(r"\[rank1 target\] \S+: done: [1-9]\d* packets sent", out), out[-3000:]
        assert re.search(r"\[rank0 drafter\] dflash_dist.models.head: drafter head from", out)
    final_digest(run_dir)
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["hidden_size"] == 64 and exported["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    assert exported["num_target_layers"] == 4
    ev = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(run_dir / "export"),
                         "--num-prompts", "2", "--max-new-tokens", "12", "--strict", *target],
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    row = [line for line in ev.stdout.splitlines() if line.startswith("synthetic-heldout")]
    assert row and row[0].split()[-1] == "yes", ev.stdout
