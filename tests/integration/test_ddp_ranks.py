"""roles.drafter_sharding=ddp between real processes (2 spawned gloo ranks): the replicas are torch's
DistributedDataParallel, their gradient is bitwise the sum the project computed before DDP (2 drafters:
DDP's average times the drafter count is exact), the whole state keeps the drafter's own names, and
optimizer steps through training/step.py with anchor chunks and an idle tail drafter keep the replicas
bitwise equal."""
import helpers
import pytest
import torch
import torch.distributed as dist
from drafter_batches import B, make_batch, make_model, step_batch, step_settings_of
from torch.nn.parallel import DistributedDataParallel

from dflash_dist.config import load_config
from dflash_dist.parallel.sharding import make_sharding
from dflash_dist.training.state import TrainState, weights_digest
from dflash_dist.training.stats import StepStats
from dflash_dist.training.step import optimizer_step, reduce_stats, step_gradients

CPU = torch.device("cpu")


def _summed_reference(rank: int, chunk: int) -> dict:
    """A bare drafter's gradient of this rank's batch (the summed weighted loss), summed over the ranks by
    one all-reduce per parameter: the replicas' gradient before DDP, before its normalisation."""
    plain = make_model()
    data, feats, anchors, acu = make_batch(rank)
    helpers.train_step(plain, data, feats, None, anchors, acu, gamma=3.0, anchor_chunk=chunk, batch_mean=False)
    for p in plain.parameters():
        dist.all_reduce(p.grad)
    return {k: p.grad for k, p in plain.named_parameters()}


def _gradient_worker(rank, q, chunk):
    model = make_model()
    sh = make_sharding("ddp", model, dist.group.WORLD, CPU)
    step_gradients(sh, step_batch(rank), step_settings_of(model, anchor_chunk=chunk), lambda: step_batch(0))
    want = _summed_reference(rank, chunk)
    got = dict(model.named_parameters())
    bitwise = all(torch.equal(got[k].grad, want[k]) for k in want)
    q.put((rank, isinstance(sh.module, DistributedDataParallel), bitwise, sorted(sh.full_model_state()),
           sorted(model.state_dict())))


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("chunk", [0, 2])
def test_ddp_replicas_reduce_to_the_summed_gradient_bitwise(chunk):
    got = sorted(helpers.spawn(2, _gradient_worker, chunk))
    for rank, wrapped, bitwise, state_keys, own_keys in got:
        assert wrapped, rank
        assert bitwise, f"rank {rank}: the DDP gradient differs from the summed one"
        assert state_keys == own_keys and not any(k.startswith("module.") for k in state_keys)


def _steps_worker(rank, q):
    """Three optimizer steps as the role makes them; in the last, rank 1 is an idle tail drafter."""
    model = make_model()
    sh = make_sharding("ddp", model, dist.group.WORLD, CPU)
    cfg = load_config(None, [])
    state = TrainState.create(model, cfg, total_steps=3)
    settings = step_settings_of(model, anchor_chunk=2)
    for step, batches in enumerate(([0, 1], [2, 0], [1])):
        mine = step_batch(batches[rank]) if rank < len(batches) else None
        m = step_gradients(sh, mine, settings, lambda: step_batch(0))
        stats = StepStats(B)
        if m is not None:
            stats.take_metrics(m)
        optimizer_step(state, sh, settings, reduce_stats(stats, dist.group.WORLD, CPU), len(batches), cfg)
    views = all(p.grad is not None and not p.grad.any() for p in sh.params)  # zeroed in place, kept
    q.put((rank, weights_digest(sh.full_model_state()), views, state.totals.steps))


@pytest.mark.slow  # several processes
def test_ddp_steps_with_an_idle_tail_drafter_keep_the_replicas_bitwise_equal():
    got = sorted(helpers.spawn(2, _steps_worker))
    assert got[0][1] == got[1][1], "the replicas' weights differ"
    assert got[0][1] != weights_digest(make_model().state_dict()), "the steps changed nothing"
    assert all(views and steps == 3 for _, _, views, steps in got), got
