"""A tiny drafter and three packed batches of unequal size (and unequal weight sums), for the tests that
hold D drafters' step (real gloo processes, DDP and FSDP2) to one process's step on the merged batch:
objective.loss_norm=step and D-PACE's position weights."""
import helpers
import torch

from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.training.objective import anchor_generator, draw_anchors

SPEC = helpers.tiny_spec()
B, V, H = SPEC.block_size, SPEC.vocab_size, SPEC.hidden_size
ALPHA = 0.5  # D-PACE's alpha, the paper's
LENGTHS = ([23, 9, 31], [6, 40], [12])  # three batches of unequal size (and unequal weight sums)


def make_model():
    torch.manual_seed(0)
    model = DFlashDrafter(SPEC)
    model.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    return model


def make_batch(i: int, vocab: int = V, feat_dim: int = 2 * H):
    """Batch i of LENGTHS for a drafter of `vocab` tokens whose features are `feat_dim` wide (a variant's
    own: tests/support/variant_models.py)."""
    gen = torch.Generator().manual_seed(100 + i)
    lens = LENGTHS[i]
    n = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    data = PackedBatch(torch.randint(0, vocab - 1, (n,), generator=gen), torch.rand(n, generator=gen) > 0.3, cu)
    anchors, anchor_cu = draw_anchors(data.loss_mask, cu, 5, anchor_generator(0, 0, i))
    return data, torch.randn(n, feat_dim, generator=gen), anchors, anchor_cu


def step_batch(i: int):
    """make_batch(i) as the step takes it (`training.step.StepBatch`, the data's labels)."""
    from dflash_dist.training.step import StepBatch
    data, feats, anchors, anchor_cu = make_batch(i)
    return StepBatch(data, feats, None, anchors, anchor_cu)


def step_settings_of(model, **objective):
    """The drafters' settings in these tests: objective.loss_norm=step, gamma 3 (the reference's), and
    `objective`'s keys (helpers.settings_of)."""
    return helpers.settings_of(model, batch_mean=False, gamma=3.0, **objective)


def saved_grads(model, rank: int, out) -> None:
    """Rank 0 saves every parameter's whole gradient (an FSDP2 shard gathered) to `out`."""
    grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for k, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out)


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


def reference_grads(num_batches: int, **objective) -> dict:
    """The gradient of one process's plain step on the merged batch (its own batch mean), under `objective`."""
    model = make_model()
    data, feats, anchors, acu = merged([make_batch(i) for i in range(num_batches)])
    helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, **objective)
    return {k: p.grad for k, p in model.named_parameters()}


def drafter_worker(rank, q, kind, num_batches, chunk, objective: dict, out):
    """One drafter doing what `Drafter.train_step` does (training/step.py): its batch's loss (or an idle
    drafter's zero-weight step), the stats all-reduce, then `normalise` by the step's totals; rank 0 saves
    the gradients. `objective`: the ObjectiveConfig keys of the step (e.g. D-PACE's alpha)."""
    import torch.distributed as dist

    from dflash_dist.parallel.sharding import make_sharding
    from dflash_dist.training.stats import StepStats
    from dflash_dist.training.step import normalise, reduce_stats, step_gradients

    model = make_model()
    sh = make_sharding(kind, model, dist.group.WORLD, torch.device("cpu"))
    settings = step_settings_of(model, anchor_chunk=chunk, **objective)
    m = step_gradients(sh, step_batch(rank) if rank < num_batches else None, settings, lambda: step_batch(0))
    stats = StepStats(B)
    if m is not None:
        stats.take_metrics(m)
    normalise(sh.params, settings, reduce_stats(stats, dist.group.WORLD, torch.device("cpu")), num_batches)
    saved_grads(model, rank, out)
    q.put(rank)


def assert_drafters_give(worker, want: dict, tmp_path, world: int, args: tuple) -> None:
    """`world` ranks (helpers.spawn) run worker(rank, queue, *args, out) and put their rank on the queue;
    rank 0 saves the step's gradients to `out`, which must equal `want`."""
    out = tmp_path / "grads.pt"
    assert sorted(helpers.spawn(world, worker, *args, str(out))) == list(range(world))
    got = torch.load(out)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def three_sequences(vocab: int, feat_dim: int):
    """(PackedBatch, features (63, feat_dim), anchors, anchor_cu): three sequences of 23, 9 and 31 tokens,
    random ids (never the last, the mask token) and a random loss mask (80%), 6 anchors a sequence: the
    batch the variants' step tests hold to their plain references."""
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 23, 32, 63])
    ids = torch.randint(0, vocab - 1, (63,), generator=gen)
    mask = torch.rand(63, generator=gen) > 0.2
    anchors, anchor_cu = draw_anchors(mask, cu, 6, anchor_generator(0, 0, 0))
    return PackedBatch(ids, mask, cu), torch.randn(63, feat_dim, generator=gen), anchors, anchor_cu
