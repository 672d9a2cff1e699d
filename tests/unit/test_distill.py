"""Distillation labels (objective.labels=target_argmax|target_soft): label construction and the soft loss."""
import math

import pytest
import torch
from oracles import dflash_loss

from dflash_dist.config import ConfigError, load_config
from dflash_dist.parallel.transport import target_label_width
from dflash_dist.training.objective import (
    argmax_block_labels,
    block_labels,
    predictions_from_hidden,
    soft_block_targets,
    target_predictions,
)

B, V = 8, 40
CU = torch.tensor([0, 20, 26])
ANCHORS, ANCHOR_CU = torch.tensor([0, 10, 19, 20]), torch.tensor([0, 3, 4])


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (26,), generator=g)
    mask = torch.ones(26, dtype=torch.bool)
    mask[15] = False
    mask[:3] = False
    return ids, mask


def _perfect_target_logits(ids, cu, seed=1):
    """Random logits whose argmax at n is the data token n + 1 (inside each sequence)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ids.numel(), V, generator=g)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        logits[torch.arange(s, e - 1), ids[s + 1:e]] = 10.0
    return logits


def test_argmax_labels_read_the_prediction_before_each_slot():
    ids, mask = _data()
    labels, w = block_labels(ids, mask, CU, ANCHORS, ANCHOR_CU, B, gamma=4.0)
    pred = 1000 + torch.arange(26)  # the target's greedy token at n, distinguishable per position
    got = argmax_block_labels(pred, labels, ANCHORS)
    assert torch.equal(got >= 0, labels >= 0)  # same trained slots; weights come from block_labels unchanged
    assert (got[:, 0] == -100).all() and (w[:, 0] == 0).all()
    for a in range(len(ANCHORS)):
        for k in range(1, B):
            if labels[a, k] >= 0:
                assert got[a, k] == pred[ANCHORS[a] + k - 1]
    assert got[3, 1] == 1020  # the block of sequence 1 at its first position reads position 20, not 19
    # A target that predicts the data perfectly gives exactly the data labels.
    ids_pred, values = target_predictions(_perfect_target_logits(ids, CU), "target_argmax", 8)
    assert values is None and ids_pred.shape == (26, 1) and ids_pred.dtype == torch.int64
    assert torch.equal(argmax_block_labels(ids_pred[:, 0], labels, ANCHORS), labels)


def test_soft_targets_are_the_renormalised_top_k_before_each_slot():
    ids, mask = _data()
    labels, _ = block_labels(ids, mask, CU, ANCHORS, ANCHOR_CU, B, gamma=4.0)
    logits = torch.randn(26, V, generator=torch.Generator().manual_seed(3))
    top_ids, top_values = target_predictions(logits, "target_soft", 5)
    assert top_ids.shape == top_values.shape == (26, 5) and top_values.dtype == torch.float32
    probs, sids, top1 = soft_block_targets(top_values, top_ids, labels, ANCHORS)
    assert probs.shape == sids.shape == (4, B, 5)
    assert torch.allclose(probs.sum(-1), torch.ones(4, B))
    for a, k in [(0, 4), (1, 1), (2, 6), (3, 1)]:
        p = ANCHORS[a] + k - 1
        want_v, want_i = logits[p].topk(5)
        assert torch.equal(sids[a, k], want_i) and torch.allclose(probs[a, k], torch.softmax(want_v, -1))
    # The metric label is the top-1 token on the trained slots only.
    assert torch.equal(top1 >= 0, labels >= 0)
    assert torch.equal(top1, argmax_block_labels(logits.argmax(-1), labels, ANCHORS))


def test_soft_loss_equals_hard_loss_when_the_target_is_one_hot_on_the_label():
    ids, mask = _data()
    labels, w = block_labels(ids, mask, CU, ANCHORS, ANCHOR_CU, B, gamma=4.0)
    # Top-k logits with all mass on the data token of the next position: softmax [1, 0, 0, 0].
    hard = torch.full((26, V), -1e4)
    hard[torch.arange(25), ids[1:]] = 0.0
    top_ids, top_values = target_predictions(hard, "target_soft", 4)
    probs, sids, top1 = soft_block_targets(top_values, top_ids, labels, ANCHORS)
    assert torch.equal(top1, labels)
    drafter = torch.randn(4, B, V, generator=torch.Generator().manual_seed(5), requires_grad=True)
    loss_h, m_h = dflash_loss(drafter, labels, w)
    g_h, = torch.autograd.grad(loss_h, drafter)
    loss_s, m_s = dflash_loss(drafter, top1, w, soft=(probs, sids))
    g_s, = torch.autograd.grad(loss_s, drafter)
    assert torch.allclose(loss_s, loss_h, rtol=1e-6) and torch.allclose(g_s, g_h, atol=1e-7)
    assert math.isclose(m_s.loss_sum, m_h.loss_sum, rel_tol=1e-6) and m_s.weight_sum == m_h.weight_sum
    assert torch.equal(m_s.correct, m_h.correct) and torch.equal(m_s.valid, m_h.valid)
    assert m_s.accept_sum == m_h.accept_sum


def test_soft_loss_is_the_weighted_cross_entropy_against_the_distribution():
    ids, mask = _data()
    labels, w = block_labels(ids, mask, CU, ANCHORS, ANCHOR_CU, B, gamma=4.0)
    top_ids, top_values = target_predictions(torch.randn(26, V), "target_soft", 3)
    probs, sids, top1 = soft_block_targets(top_values, top_ids, labels, ANCHORS)
    drafter = torch.randn(4, B, V)
    loss, _ = dflash_loss(drafter, top1, w, soft=(probs, sids))
    logq = torch.log_softmax(drafter, -1)
    want = sum(float(w[a, k]) * -sum(float(probs[a, k, i]) * float(logq[a, k, sids[a, k, i]]) for i in range(3))
               for a in range(4) for k in range(B)) / float(w.sum())
    assert math.isclose(float(loss), want, rel_tol=1e-5)
    # The target's own top-k logits (rest far below) minimise it: a perturbed drafter does worse.
    own = torch.full((4, B, V), -30.0).scatter(-1, sids, torch.log(probs))
    best, _ = dflash_loss(own, top1, w, soft=(probs, sids))
    worse, _ = dflash_loss(own + torch.randn(4, B, V), top1, w, soft=(probs, sids))
    assert float(best) < float(worse)


@pytest.mark.parametrize("labels", ["target_argmax", "target_soft"])
def test_predictions_from_the_final_hidden_state_in_chunks_equal_the_full_logits(labels):
    """The target role never builds the whole (N, V) logits: chunks of lm_head(final) give the same labels."""
    from dflash_dist.config import load_config
    from dflash_dist.models.qwen3 import TinyQwen3

    torch.manual_seed(0)
    model = TinyQwen3(load_config(None, []).model.target)
    ids, cu = torch.randint(0, model.vocab_size, (45,)), torch.tensor([0, 20, 45])
    pos = torch.cat([torch.arange(20), torch.arange(25)])
    feats, logits = model.capture(ids, cu, pos, [0, 1], need_logits=True)
    feats2, final = model.capture(ids, cu, pos, [0, 1], final_hidden=True)
    assert torch.equal(feats, feats2) and final.shape == (45, model.hidden_size)
    full_ids, full_values = target_predictions(logits, labels, 5)
    got_ids, got_values = predictions_from_hidden(final, model.lm_head, labels, 5, chunk=7)  # 7 chunks, last short
    assert torch.equal(got_ids, full_ids)
    if labels == "target_soft":
        assert torch.allclose(got_values, full_values, atol=1e-5)
    else:
        assert got_values is None and full_values is None


def test_label_width_and_config():
    assert [target_label_width(k, 8) for k in ("data", "target_argmax", "target_soft")] == [0, 1, 8]
    cfg = load_config(None, ["objective.labels=target_soft", "objective.soft_top_k=4"])
    assert cfg.objective.labels == "target_soft" and cfg.objective.soft_top_k == 4
    assert load_config(None, []).objective.labels == "data"
    for bad, key in [("objective.labels=soft", "objective.labels"), ("objective.soft_top_k=0", "objective.soft_top_k"),
                     ("objective.soft_top_k=1000", "objective.soft_top_k")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["objective.labels=target_soft", bad] if "top_k" in bad else [bad])


# -- the packet's extra payload between two real processes ------------------------------------------------



# -- the real entry point ---------------------------------------------------------------------------------


