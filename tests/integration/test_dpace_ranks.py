"""D-PACE (objective.position_weights=dpace) between real processes: D drafters' gradient (spawned gloo
ranks, DDP and FSDP2, the role's own stats all-reduce) against one merged batch's, and a short run under
torchrun that trains, stops, resumes and exports."""
import json
import math
import signal

import helpers
import pytest
from drafter_batches import (
    ALPHA,
    assert_drafters_give,
    drafter_worker,
    reference_grads,
)


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("world, num_batches, chunk", [(3, 2, 2), (3, 3, 1)])  # an idle tail drafter; chunks
def test_a_dpace_step_of_several_drafters_is_one_batch_of_all_their_samples(tmp_path, kind, world, num_batches,
                                                                            chunk):
    assert_drafters_give(drafter_worker, reference_grads(num_batches, dpace_alpha=ALPHA), tmp_path, world,
                         (kind, num_batches, chunk, {"dpace_alpha": ALPHA}))


@pytest.mark.slow  # whole runs under torchrun
def test_a_dpace_run_trains_stops_resumes_and_exports(tmp_path):
    job = ["objective.position_weights=dpace", "train.epochs=2", "data.synthetic.num_samples=400",
           "train.sync_every=2"]
    out, _, rc = helpers.interrupt(3, job, tmp_path, 6, lambda p: p.send_signal(signal.SIGTERM), 60)
    assert rc != 0 and "stopped on request" in out, out[-3000:]
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())
    res = helpers.torchrun(3, job, tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    assert "resumed from" in log
    recs = [r for r in helpers.metrics(tmp_path) if r.get("kind") == "step"]
    assert recs and all(math.isfinite(r["loss"]) for r in recs)
    first, last = recs[:5], recs[-5:]
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first), "the loss must fall"
    assert (tmp_path / "export" / "model.safetensors").is_file()
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] >= 0
