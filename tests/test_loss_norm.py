"""objective.loss_norm=step: the gradient of D drafters' step is that of one batch made of all their samples.

Real processes (gloo), each drafter running the calls the drafter role makes: loss_scale(1), the step
without the batch mean, finish_grads(1), then scale_grads(1 / the step's all-reduced weight sum). The
reference is one process's plain step on the merged batch (its own weight sum). DDP and FSDP2, with an
idle tail drafter and with anchor chunks.
"""
import os
import time

import pytest
import helpers
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_dist.bench.transport import free_port
from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec
from dflash_dist.training.objective import anchor_generator, draw_anchors
from dflash_dist.parallel.sharding import make_sharding


B, V, H = 4, 48, 32
SPEC = DraftSpec(vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, rope_theta=10000.0, rms_eps=1e-6, block_size=B, mask_token_id=V - 1,
                 target_layer_ids=(0, 1), num_target_layers=3)
LENGTHS = ([23, 9, 31], [6, 40], [12])  # three batches of unequal size (and unequal weight sums)


def make_model():
    torch.manual_seed(0)
    model = DFlashDrafter(SPEC)
    model.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    return model


def make_batch(i: int):
    gen = torch.Generator().manual_seed(100 + i)
    lens = LENGTHS[i]
    n = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    data = PackedBatch(torch.randint(0, V - 1, (n,), generator=gen), torch.rand(n, generator=gen) > 0.3, cu)
    anchors, anchor_cu = draw_anchors(data.loss_mask, cu, 5, anchor_generator(0, 0, i))
    return data, torch.randn(n, 2 * H, generator=gen), anchors, anchor_cu


def merged(batches):
    """One packed batch holding every batch's sequences, features and anchors."""
    shift, cu, anchors, acu = 0, [torch.zeros(1, dtype=torch.long)], [], [torch.zeros(1, dtype=torch.long)]
    for data, _, a, a_cu in batches:
        cu.append(data.cu_seqlens[1:] + shift)
        anchors.append(a + shift)
        acu.append(a_cu[1:] + acu[-1][-1])
        shift += data.num_tokens
    data = PackedBatch(torch.cat([b[0].input_ids for b in batches]), torch.cat([b[0].loss_mask for b in batches]),
                       torch.cat(cu))
    return data, torch.cat([b[1] for b in batches]), torch.cat(anchors), torch.cat(acu)


def reference_grads(num_batches: int) -> dict:
    model = make_model()
    data, feats, anchors, acu = merged([make_batch(i) for i in range(num_batches)])
    helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0)  # the merged batch's own mean
    return {k: p.grad for k, p in model.named_parameters()}


def _worker(rank, world, port, kind, num_batches, chunk, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
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
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("world, num_batches, chunk", [(2, 2, 0), (3, 2, 2), (3, 3, 1)])
def test_a_step_of_several_drafters_is_one_batch_of_all_their_samples(tmp_path, kind, world, num_batches, chunk):
    assert_drafters_give(_worker, reference_grads(num_batches), tmp_path, world, (kind, num_batches, chunk), 120)


def assert_drafters_give(worker, want: dict, tmp_path, world: int, args: tuple, deadline_s: float) -> None:
    """`world` spawned ranks run worker(rank, world, port, *args, out); rank 0 saves the step's gradients to
    `out`, which must equal `want`. One deadline for all ranks; stragglers are killed, never awaited."""
    out, port = tmp_path / "grads.pt", free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = torch.load(out)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)



def test_the_mean_of_batch_means_is_another_gradient():
    """loss_norm=batch on the same unequal batches: the test above would see the difference."""
    model = make_model()
    for i in range(2):
        data, feats, anchors, acu = make_batch(i)
        helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, scale=0.5)  # mean of 2 batch means
    want = reference_grads(2)
    rel = max(float((p.grad - want[k]).norm() / want[k].norm()) for k, p in model.named_parameters())
    assert rel > 0.05, rel
