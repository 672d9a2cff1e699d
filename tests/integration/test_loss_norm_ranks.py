"""objective.loss_norm=step: the gradient of D drafters' step is that of one batch made of all their samples.

Real processes (gloo), each drafter running the functions of one optimizer step that the drafter role
calls (training/step.py): `step_gradients` (its batch, or an idle tail drafter's zero-weight step),
`reduce_stats`, `normalise`. The reference is one process's plain step on the merged batch (its own weight
sum). DDP and FSDP2, with an idle tail drafter and with anchor chunks."""

import pytest
import torch
import torch.distributed as dist
from drafter_batches import (
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
    model = make_model()
    sh = make_sharding(kind, model, dist.group.WORLD, torch.device("cpu"))
    settings = step_settings_of(model, anchor_chunk=chunk)
    m = step_gradients(sh, step_batch(rank) if rank < num_batches else None, settings, lambda: step_batch(0))
    stats = StepStats(B)
    if m is not None:
        stats.take_metrics(m)
    normalise(sh.params, settings, reduce_stats(stats, dist.group.WORLD, torch.device("cpu")), num_batches)
    saved_grads(model, rank, out)
    q.put(rank)


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("world, num_batches, chunk", [(2, 2, 0), (3, 2, 2), (3, 3, 1)])
def test_a_step_of_several_drafters_is_one_batch_of_all_their_samples(tmp_path, kind, world, num_batches, chunk):
    assert_drafters_give(_worker, reference_grads(num_batches), tmp_path, world, (kind, num_batches, chunk))
