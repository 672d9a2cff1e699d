"""lm_head_loss: the chunked LM head + loss equals the full-logits computation, and keeps no (rows x V)."""
import pytest
import torch
import torch.nn.functional as F
from oracles import dflash_loss
from probes import LargestOutput

from dflash_dist.training.objective import argmax_block_labels, block_labels, lm_head_loss, soft_block_targets

A, B, H, V, K = 7, 6, 16, 300, 4  # A*B = 42 rows, 35 of them past slot 0


def batch(mode: str, seed: int = 0):
    """hidden (A, B, H) requiring grad, head (V, H), and labels/weights/soft as the drafter builds them."""
    g = torch.Generator().manual_seed(seed)
    n = 60
    ids = torch.randint(0, V, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    cu = torch.tensor([0, 25, 38, n])
    anchors = torch.tensor([0, 4, 11, 19, 25, 30, 55])  # 19 and 30 run past their sequence; 55 past the end
    anchor_cu = torch.tensor([0, 4, 6, 7])
    labels, weights = block_labels(ids, mask, cu, anchors, anchor_cu, B, gamma=4.0)
    soft = None
    if mode == "target_argmax":
        labels = argmax_block_labels(torch.randint(0, V, (n,), generator=g), labels, anchors)
    elif mode == "target_soft":
        top_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])
        probs, sids, labels = soft_block_targets(torch.randn(n, K, generator=g).sort(-1, descending=True).values,
                                                 top_ids, labels, anchors)
        soft = (probs, sids)
    hidden = torch.randn(A, B, H, generator=g).requires_grad_()
    head = torch.randn(V, H, generator=g) * H ** -0.5
    return hidden, head, labels, weights, soft


def full_reference(hidden, head, labels, weights, soft):
    """sum w * ce over the whole (A, B, V) logits at once, and its gradient w.r.t. hidden."""
    logits = hidden @ head.T
    if soft is None:
        ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1).clamp(min=0), reduction="none").view(A, B)
    else:
        ce = -(soft[0] * torch.log_softmax(logits, -1).gather(-1, soft[1])).sum(-1)
    loss = (ce * weights).sum()
    (grad,) = torch.autograd.grad(loss, hidden)
    return loss.detach(), grad


@pytest.mark.parametrize("mode", ["data", "target_argmax", "target_soft"])
@pytest.mark.parametrize("rows", [8, 13, 1000])  # 35 valid rows: chunks that do not divide them, and one chunk
def test_loss_gradient_and_metrics_equal_the_full_computation(mode, rows):
    hidden, head, labels, weights, soft = batch(mode)
    assert (labels[:, 1:] >= 0).sum() < (A * (B - 1))  # some rows have no label and are skipped
    want_loss, want_grad = full_reference(hidden, head, labels, weights, soft)
    loss, m = lm_head_loss(hidden, head, labels, weights, soft=soft, rows=rows)
    (grad,) = torch.autograd.grad(loss, hidden)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert grad[:, 0].abs().sum() == 0  # slot 0 never counts

    _, ref = dflash_loss((hidden @ head.T).detach(), labels, weights, soft=soft)
    assert m.loss_sum == pytest.approx(ref.loss_sum, rel=1e-5)
    assert m.weight_sum == pytest.approx(ref.weight_sum, rel=1e-6)
    assert torch.equal(m.correct, ref.correct) and torch.equal(m.valid, ref.valid)
    assert m.accept_sum == ref.accept_sum and m.num_blocks == ref.num_blocks == A


def test_metrics_count_hits_when_the_head_predicts_the_labels():
    """A head that maps hidden row r to label r: every trained slot is a hit, the prefix runs to the end."""
    hidden, head, labels, weights, _ = batch("data")
    onehot = torch.zeros(A, B, V)
    onehot.scatter_(-1, labels.clamp(min=0)[..., None], 10.0)
    _, m = lm_head_loss(onehot, torch.eye(V), labels, weights, rows=5)
    assert torch.equal(m.correct, m.valid) and m.valid[0] == 0 and m.valid.sum() > 0
    _, ref = dflash_loss(onehot @ torch.eye(V), labels, weights)
    assert m.accept_sum == ref.accept_sum > A


def test_scaled_gradient_and_no_grad_path():
    hidden, head, labels, weights, _ = batch("data")
    want_loss, want_grad = full_reference(hidden, head, labels, weights, None)
    loss, _ = lm_head_loss(hidden, head, labels, weights, rows=9)
    (loss * 0.25).backward()
    torch.testing.assert_close(hidden.grad, 0.25 * want_grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        loss2, _ = lm_head_loss(hidden, head, labels, weights, rows=9)
    assert loss2.grad_fn is None
    torch.testing.assert_close(loss2, want_loss, rtol=1e-5, atol=1e-6)


def test_no_labels_and_bad_arguments():
    hidden, head, labels, weights, _ = batch("data")
    none = torch.full_like(labels, -100)
    loss, m = lm_head_loss(hidden, head, none, weights * 0, rows=4)
    loss.backward()
    assert float(loss.detach()) == 0.0 and hidden.grad.abs().sum() == 0 and m.valid.sum() == 0
    with pytest.raises(ValueError, match="frozen"):
        lm_head_loss(hidden, head.clone().requires_grad_(), labels, weights)
    with pytest.raises(ValueError, match="rows"):
        lm_head_loss(hidden, head, labels, weights, rows=0)


@pytest.mark.parametrize("mode", ["data", "target_soft"])
def test_nothing_vocabulary_sized_is_saved_and_at_most_rows_of_logits_live(mode):
    hidden, head, labels, weights, soft = batch(mode)
    valid_rows = int((labels >= 0).sum())
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    rows = 8
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), LargestOutput() as probe:
        loss, _ = lm_head_loss(hidden, head, labels, weights, soft=soft, rows=rows)
        loss.backward()
    assert saved, "the loss saves its input gradient for backward"
    assert all(V not in t.shape for t in saved)
    assert sum(t.numel() for t in saved) <= valid_rows * H + valid_rows  # the (rows, H) gradient and its index
    assert probe.largest == rows * V
    # The probe sees a whole batch of logits when the chunk holds every row.
    with LargestOutput() as probe:
        lm_head_loss(hidden, head, labels, weights, soft=soft, rows=A * B)[0].backward()
    assert probe.largest == valid_rows * V
