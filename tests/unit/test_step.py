"""The drafter step: anchor chunks, layer checkpointing and the fused context change memory, not results."""
import helpers
import pytest
import torch
from oracles import dflash_loss

from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.parallel.transport import TargetLabels
from dflash_dist.training.objective import anchor_generator, draw_anchors
from dflash_dist.training.step import batch_targets

SPEC = helpers.tiny_spec()
B, V, H = SPEC.block_size, SPEC.vocab_size, SPEC.hidden_size


def make_model(checkpoint_layers=False):
    torch.manual_seed(0)
    model = DFlashDrafter(SPEC, checkpoint_layers=checkpoint_layers)
    model.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    return model


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(1)
    lens = [23, 9, 31]
    cu = torch.tensor([0, 23, 32, 63])
    ids = torch.randint(0, V - 1, (63,), generator=gen)
    mask = torch.rand(63, generator=gen) > 0.2
    data = PackedBatch(ids, mask, cu)
    anchors, anchor_cu = draw_anchors(mask, cu, 6, anchor_generator(0, 0, 0))
    assert anchors.numel() >= 9 and sum(lens) == 63
    feats = torch.randn(63, 2 * H, generator=gen)
    n = 63
    argmax = TargetLabels(torch.randint(0, V, (n, 1), generator=gen))
    soft = TargetLabels(torch.randint(0, V, (n, 3), generator=gen), torch.randn(n, 3, generator=gen))
    return data, feats, anchors, anchor_cu, {"data": None, "target_argmax": argmax, "target_soft": soft}


def grads_of(model, data, feats, anchors, anchor_cu, target, **kw):
    model.zero_grad(set_to_none=True)
    m = helpers.train_step(model, data, feats, target, anchors, anchor_cu, gamma=7.0, **kw)
    return {k: p.grad.clone() for k, p in model.named_parameters()}, m


def reference_grads(model, data, feats, anchors, anchor_cu, target):
    """The plain computation: whole logits, one loss, one backward."""
    model.zero_grad(set_to_none=True)
    labels, weights, soft = batch_targets(data, target, anchors, anchor_cu, B, 7.0)
    logits = model.block_logits(feats, data.input_ids, data.cu_seqlens, data.position_ids, anchors, anchor_cu)
    loss, m = dflash_loss(logits, labels, weights, soft)
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, m


@pytest.mark.parametrize("labels", ["data", "target_argmax", "target_soft"])
@pytest.mark.parametrize("anchor_chunk, loss_rows", [(0, 8192), (4, 7), (1, 5)])
def test_chunked_step_equals_the_plain_step(batch, labels, anchor_chunk, loss_rows):
    data, feats, anchors, anchor_cu, targets = batch
    # Chunks of 4 (and 1) cut through a sequence's anchors: sequence 0 holds 6 of them.
    assert int(anchor_cu[1]) == 6
    model = make_model()
    want, wm = reference_grads(model, data, feats, anchors, anchor_cu, targets[labels])
    got, gm = grads_of(model, data, feats, anchors, anchor_cu, targets[labels], anchor_chunk=anchor_chunk,
                       loss_rows=loss_rows)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)
    assert gm.loss_sum == pytest.approx(wm.loss_sum, rel=1e-5) and gm.weight_sum == pytest.approx(wm.weight_sum)
    assert torch.equal(gm.correct, wm.correct) and torch.equal(gm.valid, wm.valid)
    assert gm.num_blocks == anchors.numel() and gm.accept_sum == pytest.approx(wm.accept_sum)


def test_layer_checkpointing_gives_the_same_gradients(batch):
    data, feats, anchors, anchor_cu, _ = batch
    plain, _ = grads_of(make_model(), data, feats, anchors, anchor_cu, None, anchor_chunk=3)
    ckpt, _ = grads_of(make_model(checkpoint_layers=True), data, feats, anchors, anchor_cu, None, anchor_chunk=3)
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-6, atol=1e-8, msg=k)


def test_the_fused_context_is_computed_once_per_step(batch):
    data, feats, anchors, anchor_cu, _ = batch
    model = make_model()
    calls = []
    model.fc.register_forward_hook(lambda *a: calls.append(1))
    grads_of(model, data, feats, anchors, anchor_cu, None, anchor_chunk=2)
    assert len(calls) == 1 and anchors.numel() > 2


def test_scale_multiplies_the_gradients(batch):
    data, feats, anchors, anchor_cu, _ = batch
    model = make_model()
    one, _ = grads_of(model, data, feats, anchors, anchor_cu, None)
    half, _ = grads_of(model, data, feats, anchors, anchor_cu, None, scale=0.5)
    for k in one:
        torch.testing.assert_close(half[k], one[k] * 0.5)


def test_a_batch_without_anchors_is_refused(batch):
    data, feats, *_ = batch
    with pytest.raises(ValueError, match="without any anchor"):
        helpers.train_step(make_model(), data, feats, None, torch.zeros(0, dtype=torch.long),
                     torch.zeros(4, dtype=torch.long), gamma=7.0)


class OneDrafterOf:
    """The sharding interface around a bare drafter, as one of `size` drafters would see it before the
    reduction (no process group): counts the chunk calls that go through `module` and the sync switch."""
    keep_grads = False

    def __init__(self, model, size: int):
        self.model, self.size, self.params = model, size, list(model.parameters())
        self.calls, self.synced = 0, []
        self.module = self._forward

    def _forward(self, *args, **kw):
        self.calls += 1
        return self.model(*args, **kw)

    def begin_step(self):
        self.synced.append(False)

    def before_last_chunk(self):
        self.synced.append(True)


def test_step_gradients_scale_a_batch_by_the_drafters_and_an_idle_drafter_by_zero(batch):
    """Both reductions average over the drafters: each batch's loss is scaled by their number, so the
    reduced gradient is the sum; the chunks go through the sharding's module (DDP's wrapper), sync on
    for the last one only; a drafter without a batch still backwards every parameter, with weight 0."""
    from dflash_dist.training.step import StepBatch, step_gradients
    data, feats, anchors, anchor_cu, _ = batch
    model = make_model()
    plain, _ = grads_of(model, data, feats, anchors, anchor_cu, None, anchor_chunk=4, batch_mean=False)
    model.zero_grad(set_to_none=True)
    sh = OneDrafterOf(model, size=3)
    settings = helpers.settings_of(model, batch_mean=False, gamma=7.0, anchor_chunk=4)
    m = step_gradients(sh, StepBatch(data, feats, None, anchors, anchor_cu), settings, None)
    assert m is not None and sh.calls == -(-anchors.numel() // 4) and sh.synced == [False, True]
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[k] * 3, msg=k)
    model.zero_grad(set_to_none=True)
    assert step_gradients(sh, None, settings, lambda: StepBatch(data, feats, None, anchors, anchor_cu)) is None
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("mode, real, want", [("step", 2, 1 / 8.0), ("dpace", 2, 1 / 5.0), ("batch", 2, 0.5),
                                              ("batch", 1, 1.0)])
def test_normalise_divides_the_reduced_sum_once(mode, real, want):
    """loss_norm=step: by the step's total weight (its blocks under D-PACE); batch: by its real batches."""
    from dflash_dist.training.stats import StepStats
    from dflash_dist.training.step import normalise
    model = make_model()
    kw = {"batch": dict(batch_mean=True), "step": dict(batch_mean=False),
          "dpace": dict(batch_mean=False, dpace_alpha=0.5)}[mode]
    settings = helpers.settings_of(model, **kw)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    normalise(params, settings, StepStats(B, weight_sum=8.0, blocks=5), real)
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0 * want)) for p in params)
