"""D-PACE (objective.position_weights=dpace) between real processes: D drafters' gradient (spawned gloo
ranks, DDP and FSDP2, the role's own stats all-reduce) against one merged batch's, and a short run under
torchrun that trains, stops, resumes and exports."""
import json
import math
import signal

import helpers
import pytest
import torch
import torch.distributed as dist
from drafter_batches import (
    ALPHA,
    B,
    assert_drafters_give,
    make_model,
    reference_grads,
    saved_grads,
    step_batch,
    step_settings_of,
)

from dflash_dist.parallel.sharding import make_sharding
from dflash_dist.training.stats import StepStats
from dflash_dist.training.step import normalise, reduce_stats, step_gradients


def _worker(rank, q, kind, num_batches, chunk, out):
    """One drafter doing what `Drafter.train_step` does under loss_norm=step (training/step.py): its
    batch's summed loss (or an idle drafter's zero-weight step), the stats all-reduce, then the gradients
    divided by `loss_denominator` of the step's totals (`normalise`)."""
    model = make_model()
    sh = make_sharding(kind, model, dist.group.WORLD, torch.device("cpu"))
    settings = step_settings_of(model, anchor_chunk=chunk, dpace_alpha=ALPHA)
    m = step_gradients(sh, step_batch(rank) if rank < num_batches else None, settings, lambda: step_batch(0))
    stats = StepStats(B)
    if m is not None:
        stats.take_metrics(m)
    normalise(sh.params, settings, reduce_stats(stats, dist.group.WORLD, torch.device("cpu")), num_batches)
    saved_grads(model, rank, out)
    q.put(rank)


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("world, num_batches, chunk", [(3, 2, 2), (3, 3, 1)])  # an idle tail drafter; chunks
def test_a_dpace_step_of_several_drafters_is_one_batch_of_all_their_samples(tmp_path, kind, world, num_batches,
                                                                            chunk):
    assert_drafters_give(_worker, reference_grads(num_batches, dpace_alpha=ALPHA), tmp_path, world,
                         (kind, num_batches, chunk))


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
