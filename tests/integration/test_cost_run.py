"""The cost model in a whole run under torchrun: the predicted times logged and recorded beside the
measured ones."""
from __future__ import annotations

import json

import pytest

from dflash_dist.bench.memory import Scaled


@pytest.mark.slow
def test_a_run_logs_and_records_predicted_beside_measured(tmp_path):
    from helpers import TINY, torchrun
    res = torchrun(2, TINY + ["train.epochs=1", f"train.run_dir={tmp_path}"], tmp_path, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    start = [line for line in out.splitlines() if "cost model (CPU (nominal), 1 x 2 GPUs)" in line]
    assert start and "best roles.drafters_per_node=1" in start[0], out[-3000:]
    first = [i for i, line in enumerate(out.splitlines()) if "batch 1/" in line or "summary:" in line][0]
    assert out.splitlines().index(start[0]) < first  # before the first batch's progress
    balance = json.loads((tmp_path / "summary.json").read_text())["balance"]
    assert balance["predicted"]["target_s_per_batch"] > 0 and balance["target_s_per_batch"] > 0
    assert any("per batch measured" in line and "predicted: target" in line for line in out.splitlines())


TINY = Scaled(hidden=64, vocab=512, intermediate=192, target_layers=4, heads=4, kv_heads=2, head_dim=16,
              draft_layers=2, seqs=3, seq_len=70, prompt=10, num_anchors=12, anchor_chunk=16, loss_rows=64)
