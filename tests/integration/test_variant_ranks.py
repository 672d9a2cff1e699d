"""Every registered drafter variant (`models.variants.VARIANTS`) trains alike over 2 drafters, DDP replicas
or FSDP2 shards: the gradient of 2 gloo ranks each stepping its own batch is one process's gradient of
the merged batch (objective.loss_norm=step: each rank's weighted sum, divided by the all-reduced weight).

Each rank makes the calls the drafter role makes: `parallel.sharding.make_sharding`, then
`training.step.step_gradients` (DDP's or FSDP's reduce in the last anchor chunk's backward; anchor chunks of
2, so the last chunk's reduce follows earlier chunks), then the step's normalisation by the all-reduced
weight (`training.step.normalise` under objective.loss_norm=step)."""
import helpers
import pytest
import torch
import torch.distributed as dist
from drafter_batches import make_batch, merged
from variant_models import NAMES, feat_dim, make_model, tiny_spec

from dflash_dist.config import Config, ObjectiveConfig
from dflash_dist.models.variants import RunProgress
from dflash_dist.parallel.sharding import make_sharding
from dflash_dist.training.stats import StepStats
from dflash_dist.training.step import StepBatch, drafter_step, normalise, step_gradients, step_settings

pytestmark = pytest.mark.slow  # several processes

WORLD = 2
KINDS = ("ddp", "fsdp")  # roles.drafter_sharding
PROGRESS = RunProgress(3, 10)  # a schedule (Domino's lambda) strictly between its ends: every head learns


def batch_of(spec, i: int):
    return make_batch(i, spec.vocab_size, feat_dim(spec))


def settings(spec, *, batch_mean: bool):
    o = ObjectiveConfig(block_size=spec.block_size, gamma=3.0, anchor_chunk=2,
                        loss_norm="batch" if batch_mean else "step")
    return step_settings(Config(objective=o), spec)


def step_batch(batch) -> StepBatch:
    data, feats, anchors, acu = batch
    return StepBatch(data, feats, None, anchors, acu, PROGRESS)


def _worker(rank, q, name, out):
    """Both shardings in turn on the same 2 ranks (one spawn a variant: the ranks' start-up is the cost)."""
    spec = tiny_spec(name)
    got = {}
    for kind in KINDS:
        model = make_model(spec)
        sh = make_sharding(kind, model, dist.group.WORLD, torch.device("cpu"))
        st = settings(spec, batch_mean=False)
        m = step_gradients(sh, step_batch(batch_of(spec, rank)), st, idle=None)
        weight = torch.tensor(float(m.weight_sum), dtype=torch.float64)
        dist.all_reduce(weight)
        normalise(sh.params, st, StepStats(spec.block_size, weight_sum=float(weight)), real=WORLD)
        got[kind] = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for k, p in model.named_parameters()}
    if rank == 0:
        torch.save(got, out)
    q.put(rank)


@pytest.mark.parametrize("name", NAMES)
def test_two_drafters_step_is_one_step_of_the_merged_batch(tmp_path, name):
    spec = tiny_spec(name)
    model = make_model(spec)
    drafter_step(model, step_batch(merged([batch_of(spec, i) for i in range(WORLD)])),
                 settings(spec, batch_mean=True))
    want = {k: p.grad for k, p in model.named_parameters()}
    assert all(g is not None and g.any() for g in want.values())  # every module of the variant is held to it
    out = tmp_path / "grads.pt"
    assert sorted(helpers.spawn(WORLD, _worker, name, str(out))) == list(range(WORLD))
    got = torch.load(out)
    assert list(got) == list(KINDS)
    for kind in KINDS:
        assert got[kind].keys() == want.keys(), kind
        for k in want:  # drafter_batches.assert_drafters_give's tolerance
            torch.testing.assert_close(got[kind][k], want[k], rtol=1e-5, atol=1e-6, msg=f"{kind}: {k}")
