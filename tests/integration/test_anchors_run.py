"""The anchor rule under torchrun (3 ranks, gloo): samples shorter than a block are all trained
(tests/unit/test_anchors.py holds the rule itself)."""
import json

import pytest
import torch
from helpers import torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them


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
