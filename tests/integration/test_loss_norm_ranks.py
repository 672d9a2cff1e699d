"""objective.loss_norm=step: the gradient of D drafters' step is that of one batch made of all their samples.

Real processes (gloo), each drafter running the calls the drafter role makes: loss_scale(1), the step
without the batch mean, finish_grads(1), then scale_grads(1 / the step's all-reduced weight sum). The
reference is one process's plain step on the merged batch (its own weight sum). DDP and FSDP2, with an
idle tail drafter and with anchor chunks."""

import pytest
import torch
import torch.distributed as dist

from dflash_dist.parallel.sharding import make_sharding

import helpers
from drafter_batches import assert_drafters_give, make_batch, make_model, reference_grads


def _worker(rank, q, kind, num_batches, chunk, out):
    model = make_model()
    sh = make_sharding(kind, model, dist.group.WORLD, torch.device("cpu"), src=0)
    sh.begin_step()
    weight = torch.zeros((), dtype=torch.float64)
    if rank < num_batches:
        data, feats, anchors, acu = make_batch(rank)
        m = helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, anchor_chunk=chunk,
                         scale=sh.loss_scale(1), batch_mean=False, before_last_chunk=sh.before_last_chunk)
        weight += float(m.weight_sum)
    elif sh.idle_computes:  # FSDP: the idle drafter's zero-weight step joins the collectives
        data, feats, anchors, acu = make_batch(0)
        helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, anchor_chunk=chunk, scale=0.0,
                     batch_mean=False, before_last_chunk=sh.before_last_chunk)
    sh.finish_grads(1)
    dist.all_reduce(weight)
    sh.scale_grads(1.0 / float(weight))
    grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for k, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out)
    q.put(rank)


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("world, num_batches, chunk", [(2, 2, 0), (3, 2, 2), (3, 3, 1)])
def test_a_step_of_several_drafters_is_one_batch_of_all_their_samples(tmp_path, kind, world, num_batches, chunk):
    assert_drafters_give(_worker, reference_grads(num_batches), tmp_path, world, (kind, num_batches, chunk))
