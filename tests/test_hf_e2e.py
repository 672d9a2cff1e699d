"""A tiny random transformers Qwen3 saved to a local directory: train (3 ranks), export, evaluate."""
import json
import subprocess
import sys

import pytest

from helpers import final_digest, torchrun

import transformers  # the `hf` extra; `dev` (what the tests install) includes it

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them


def test_hf_target_trains_exports_and_evaluates(tmp_path):
    import torch
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_dir = tmp_path / "qwen3-tiny"
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
    target = ["model.target.kind=hf", f"model.target.path={model_dir}", "model.draft.target_layer_ids=[0,1,2]"]
    run_dir = tmp_path / "run"
    res = torchrun(3, target + ["train.epochs=1", "data.synthetic.regenerate=false"], run_dir)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    final_digest(out)
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["hidden_size"] == 64 and exported["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    assert exported["num_target_layers"] == 4
    ev = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(run_dir / "export"),
                         "--num-prompts", "2", "--max-new-tokens", "12", "--strict", *target],
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    row = [line for line in ev.stdout.splitlines() if line.startswith("synthetic-heldout")]
    assert row and row[0].split()[-1] == "yes", ev.stdout
