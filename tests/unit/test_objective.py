import math

import helpers
import numpy as np
import pytest
import torch
from oracles import dflash_loss

from dflash_dist.data.collate import position_ids
from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.training.objective import anchor_generator, block_labels, draw_anchors

B = 8
SPEC = helpers.tiny_spec(vocab_size=64, block_size=B)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = DFlashDrafter(SPEC).double()
    model.attach_target_head(torch.nn.Embedding(64, 32).double(), torch.nn.Linear(32, 64, bias=False).double())
    cu = torch.tensor([0, 30, 50])
    ids = torch.randint(0, 63, (50,))
    feats = torch.randn(50, 64, dtype=torch.float64)
    anchors = torch.tensor([5, 12, 33])  # two blocks in sequence 0 (anchors 5, 12), one in sequence 1 (3)
    anchor_cu = torch.tensor([0, 2, 3])
    return model, feats, ids, cu, anchors, anchor_cu


def logits(setup, feats=None, ids=None):
    model, f, i, cu, a, acu = setup
    f = f if feats is None else feats
    i = i if ids is None else ids
    with torch.no_grad():
        return model.block_logits(f, i, cu, position_ids(cu), a, acu)


def test_block_sees_only_context_before_its_anchor_and_its_own_block(setup):
    base = logits(setup)
    _, f, ids, *_ = setup
    # Context at or after anchor 5 (same sequence): block 0 unchanged, block 1 (anchor 12) changed.
    f2 = f.clone()
    f2[5:30] += torch.randn(25, 64, dtype=f.dtype)
    out = logits(setup, feats=f2)
    assert torch.equal(out[0], base[0])
    assert not torch.allclose(out[1], base[1])
    # Another sequence: blocks of sequence 0 unchanged.
    f3 = f.clone()
    f3[30:] += 1.0
    out = logits(setup, feats=f3)
    assert torch.equal(out[:2], base[:2]) and not torch.allclose(out[2], base[2])
    # Another block: changing block 1's anchor token does not reach block 0 (nor sequence 1's block).
    ids2 = ids.clone()
    ids2[12] = (ids[12] + 1) % 63
    out = logits(setup, ids=ids2)
    assert torch.equal(out[0], base[0]) and torch.equal(out[2], base[2]) and not torch.allclose(out[1], base[1])
    # Context strictly before the anchor is seen.
    f4 = f.clone()
    f4[2] += 1.0
    out = logits(setup, feats=f4)
    assert not torch.allclose(out[0], base[0])
    # Token ids of the context are not an input (only features are): changing one changes nothing.
    ids3 = ids.clone()
    ids3[3] = (ids[3] + 1) % 63
    assert torch.equal(logits(setup, ids=ids3), base)


def test_anchor_position_of_the_context_itself_is_hidden(setup):
    base = logits(setup)
    _, f, *_ = setup
    f2 = f.clone()
    f2[5] += 5.0  # the target's state AT the anchor is not available at inference
    assert torch.equal(logits(setup, feats=f2)[0], base[0])
    f2 = f.clone()
    f2[4] += 5.0
    assert not torch.allclose(logits(setup, feats=f2)[0], base[0])


def test_labels_and_weights():
    cu = torch.tensor([0, 20, 26])
    ids = torch.arange(26)
    mask = torch.ones(26, dtype=torch.bool)
    mask[15] = False
    anchors, acu = torch.tensor([10, 19, 20]), torch.tensor([0, 2, 3])
    labels, w = block_labels(ids, mask, cu, anchors, acu, B, gamma=4.0)
    assert (w[:, 0] == 0).all() and (labels[:, 0] == -100).all()  # slot 0 is never trained
    assert labels[0, 1].item() == 11 and math.isclose(w[0, 1].item(), 1.0)
    assert math.isclose(w[0, 3].item(), math.exp(-2 / 4.0), rel_tol=1e-6)
    assert w[0, 5] == 0 and labels[0, 5] == -100  # position 15 is outside the loss mask
    assert (w[1, 1:] == 0).all()  # anchor 19: every label lies past the end of sequence 0
    assert (w[2, 6:] == 0).all() and (w[2, 1:6] > 0).all()  # sequence 1 ends at 26


def test_anchors_precede_a_supervised_token_up_to_the_end_and_are_reproducible():
    cu = torch.tensor([0, 40, 45, 100])
    mask = torch.zeros(100, dtype=torch.bool)
    mask[10:40] = True
    mask[60:100] = True
    a1, acu1 = draw_anchors(mask, cu, 5, anchor_generator(1, 2, 3))
    a2, acu2 = draw_anchors(mask, cu, 5, anchor_generator(1, 2, 3))
    assert torch.equal(a1, a2) and torch.equal(acu1, acu2)
    assert acu1.tolist() == [0, 5, 5, 10]  # sequence 1 has no supervised token
    ends = torch.repeat_interleave(cu[1:], acu1[1:] - acu1[:-1])
    assert (a1 + 2 <= ends).all() and mask[a1 + 1].all()
    a3, _ = draw_anchors(mask, cu, 5, anchor_generator(1, 2, 4))
    assert not torch.equal(a1, a3)
    # Every candidate, when all are drawn: p = 9..38 and 59..98, blocks running past the sequences' ends.
    every, acu = draw_anchors(mask, cu, 1000, anchor_generator(0, 0, 0))
    assert every.tolist() == list(range(9, 39)) + list(range(59, 99)) and acu.tolist() == [0, 30, 30, 70]


def test_a_response_shorter_than_a_block_is_trained_to_its_last_token_at_slot_1():
    """A 3-token prompt and a 5-token answer, B = 16: five anchors (the last prompt token and the first
    four answer tokens)
    the last answer token is the slot-1 label of the anchor just before it, and the
    slots past the end carry no label and no weight."""
    B16, cu = 16, torch.tensor([0, 8])
    ids = torch.arange(100, 108)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    anchors, acu = draw_anchors(mask, cu, 512, anchor_generator(0, 0, 0))
    assert anchors.tolist() == [2, 3, 4, 5, 6]
    labels, w = block_labels(ids, mask, cu, anchors, acu, B16, gamma=7.0)
    assert labels[-1, 1].item() == 107 and math.isclose(w[-1, 1].item(), 1.0)  # the last token, slot 1
    for j, p in enumerate(anchors.tolist()):
        inside = 8 - p  # slots 0 .. inside - 1 lie inside the sequence
        assert (labels[j, 1:inside] == ids[p + 1:8]).all() and (w[j, 1:inside] > 0).all()
        assert (labels[j, inside:] == -100).all() and (w[j, inside:] == 0).all()
    # The last token is trained at every slot 1..5 (once per anchor before it), the first answer token at 1.
    assert sorted(int(k) for k in torch.nonzero(labels == 107)[:, 1]) == [1, 2, 3, 4, 5]


def test_no_anchor_means_no_supervised_token_after_the_first():
    from dflash_dist.data.dataset import TokenDataset
    from dflash_dist.plan.epochs import build_plan
    masks = [[1, 0, 0], [0, 1], [1], [1, 1], [0, 0, 0, 1], [1, 0, 1]]
    offsets = np.cumsum([0] + [len(m) for m in masks])
    ds = TokenDataset(np.zeros(offsets[-1], dtype=np.int64), offsets, np.concatenate(masks).astype(np.uint8), 10)
    assert ds.num_anchorable.tolist() == [0, 1, 0, 1, 1, 1]
    cu = torch.from_numpy(offsets)
    _, acu = draw_anchors(torch.from_numpy(ds.loss_mask.astype(bool)), cu, 100, anchor_generator(0, 0, 0))
    assert np.diff(acu.numpy()).tolist() == ds.num_anchorable.tolist()  # the plan counts what the draw finds
    plan = build_plan(ds.lengths, ds.num_supervised, anchorable=ds.num_anchorable, seed=0, epoch=0,
                      token_budget=64, max_seqs=8)
    assert plan.skipped["no_anchor"] == 2 and sorted(plan.indices.tolist()) == [1, 3, 4, 5]


def test_gradients_reach_only_the_drafter(setup):
    model, f, ids, cu, a, acu = setup
    mask = torch.ones(50, dtype=torch.bool)
    labels, w = block_labels(ids, mask, cu, a, acu, B, 3.0)
    loss, _ = dflash_loss(model.block_logits(f, ids, cu, position_ids(cu), a, acu), labels, w)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model._embed.weight.grad is None and model._lm_head.weight.grad is None
    assert set(model.state_dict()) == {k for k, _ in model.named_parameters()}
    model.zero_grad()
