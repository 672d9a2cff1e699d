"""objective.position_weights=dpace: D-PACE's position weights (arXiv 2605.18810), normalised over the step.

The weights against a hand computation and a plain loop over the formula; the chunked LM head and the
drafter step (anchor chunks, row chunks) against the whole computation; D drafters' gradient (real gloo
processes, DDP and FSDP2, the role's own stats all-reduce) against one merged batch's; the config keys;
and a short run under torchrun that trains, stops, resumes and exports.
"""
import math

import helpers
import pytest
import torch
import torch.nn.functional as F
from drafter_batches import ALPHA, make_batch, make_model, reference_grads

from dflash_dist.config import ConfigError, load_config
from dflash_dist.training.objective import block_labels, dpace_weights, lm_head_loss, loss_denominator


def loop_weights(ce, trained, alpha):
    """The formula as written, one block and one slot at a time: w_k = sum_{m >= k} prod_{i <= m} q~_i
    over trained slots, q~ = (1 - alpha) exp(-ce) + alpha; untrained slots weigh 0 and multiply by 1."""
    A, Bk = ce.shape
    out = torch.zeros(A, Bk, dtype=torch.float64)
    for a in range(A):
        smooth = [(1 - alpha) * math.exp(-float(ce[a, i])) + alpha if trained[a, i] else 1.0 for i in range(Bk)]
        for k in range(Bk):
            if trained[a, k]:
                out[a, k] = sum(math.prod(smooth[:m + 1]) for m in range(k, Bk) if trained[a, m])
    return out


def test_weights_equal_a_hand_computation():
    # Block 0: confidences 0.8, 0.5, (slot 3 untrained), 0.4 -> smoothed 0.9, 0.75, 1, 0.7; reach
    # 0.9, 0.675, -, 0.4725; weights are the sums of the reach from each slot on.
    # Block 1 at alpha 0.5 with every q = 1: smoothed 1, so w_k = the trained slots from k on: 4, 3, 2, 1.
    q = torch.tensor([[1.0, 0.8, 0.5, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0, 1.0]])
    trained = torch.tensor([[False, True, True, False, True], [False, True, True, True, True]])
    w = dpace_weights(-q.log(), trained, ALPHA)
    want = torch.tensor([[0.0, 0.9 + 0.675 + 0.4725, 0.675 + 0.4725, 0.0, 0.4725], [0.0, 4.0, 3.0, 2.0, 1.0]])
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7)
    assert not w.requires_grad
    # alpha = 1: every confidence smoothed to 1, the weights no longer depend on the drafter.
    torch.testing.assert_close(dpace_weights(-q.log(), trained, 1.0)[0], torch.tensor([0.0, 3.0, 2.0, 0.0, 1.0]))


def test_weights_equal_the_formula_on_random_blocks():
    g = torch.Generator().manual_seed(3)
    ce = torch.rand(9, 7, generator=g) * 4
    trained = torch.rand(9, 7, generator=g) > 0.3
    trained[:, 0] = False
    for alpha in (0.1, 0.5, 1.0):
        torch.testing.assert_close(dpace_weights(ce, trained, alpha).double(), loop_weights(ce, trained, alpha),
                                   rtol=1e-5, atol=1e-6)


def head_case(seed=0):
    """hidden (A, B, H), a frozen head (V, H), labels with untrained slots (past a sequence, masked)."""
    g = torch.Generator().manual_seed(seed)
    A, Bk, H, V, n = 7, 6, 16, 300, 60
    ids, mask = torch.randint(0, V, (n,), generator=g), torch.rand(n, generator=g) > 0.2
    anchors, anchor_cu = torch.tensor([0, 4, 11, 19, 25, 30, 55]), torch.tensor([0, 4, 6, 7])
    labels, _ = block_labels(ids, mask, torch.tensor([0, 25, 38, n]), anchors, anchor_cu, Bk, gamma=4.0)
    hidden = torch.randn(A, Bk, H, generator=g).requires_grad_()
    return hidden, torch.randn(V, H, generator=g) * H ** -0.5, labels


@pytest.mark.parametrize("rows", [5, 13, 1000])  # row chunks that cut blocks apart, and one chunk
def test_lm_head_loss_under_dpace_equals_the_whole_computation(rows):
    hidden, head, labels = head_case()
    trained = labels >= 0
    logits = hidden @ head.T
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).clamp(min=0),
                         reduction="none").view(labels.shape)
    w = loop_weights(ce.detach(), trained, ALPHA).float()
    want_loss = (ce * w).sum()
    (want_grad,) = torch.autograd.grad(want_loss, hidden)
    loss, m = lm_head_loss(hidden, head, labels, trained.float(), rows=rows, dpace_alpha=ALPHA)
    (grad,) = torch.autograd.grad(loss, hidden)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m.weight_sum, w.sum(), rtol=1e-6, atol=1e-6)
    # ... and it is not the fixed decay's: the weights follow the drafter's confidences.
    gamma_loss, _ = lm_head_loss(hidden, head, labels, trained.float(), rows=rows)
    assert abs(float(gamma_loss.detach()) - float(loss.detach())) > 1e-3 * abs(float(loss.detach()))


def test_dpace_needs_hard_labels():
    hidden, head, labels = head_case()
    soft = (torch.ones(*labels.shape, 2) / 2, torch.zeros(*labels.shape, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="hard labels"):
        lm_head_loss(hidden, head, labels, (labels >= 0).float(), soft=soft, dpace_alpha=ALPHA)


def step_grads(chunk: int, rows: int, dpace_alpha=ALPHA, batch: int = 0):
    model = make_model()
    data, feats, anchors, acu = make_batch(batch)
    m = helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, anchor_chunk=chunk, loss_rows=rows,
                     dpace_alpha=dpace_alpha)
    return {k: p.grad for k, p in model.named_parameters()}, m, anchors.numel()


def test_the_weights_and_gradient_do_not_depend_on_chunking():
    want, m0, A = step_grads(0, 8192)
    for chunk, rows in [(1, 8192), (3, 8192), (2, 5), (0, 7)]:
        got, m, _ = step_grads(chunk, rows)
        assert math.isclose(float(m.weight_sum), float(m0.weight_sum), rel_tol=1e-6), (chunk, rows)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=f"{k} chunk={chunk} rows={rows}")
    gamma, _, _ = step_grads(0, 8192, dpace_alpha=None)
    assert max(float((gamma[k] - want[k]).norm() / want[k].norm()) for k in want) > 0.05


def test_a_batch_mean_under_dpace_divides_by_the_blocks_not_the_weight_sum():
    mean, m, A = step_grads(0, 8192)
    model = make_model()
    data, feats, anchors, acu = make_batch(0)
    helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, batch_mean=False, dpace_alpha=ALPHA)
    assert m.num_blocks == A and not math.isclose(float(m.weight_sum), A, rel_tol=1e-3)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad / A, mean[k], rtol=1e-5, atol=1e-8, msg=k)
    assert loss_denominator(True, 7.5, 3) == 3 and loss_denominator(False, 7.5, 3) == 7.5


def test_a_rank_local_denominator_is_another_gradient():
    """What tests/integration/test_dpace_ranks.py tells apart (AutoModel PR 2572's bug): each batch divided by its own blocks,
    then averaged over the batches, on batches of 3, 2 and 1 sequences (unequal anchor counts)."""
    model = make_model()
    for i in range(3):
        data, feats, anchors, acu = make_batch(i)
        helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, scale=1 / 3, dpace_alpha=ALPHA)
    want = reference_grads(3, dpace_alpha=ALPHA)  # the merged batch divided by its own blocks
    rel = max(float((p.grad - want[k]).norm() / want[k].norm()) for k, p in model.named_parameters())
    assert rel > 0.05, rel


def test_config_keys():
    o = load_config(None, []).objective
    assert (o.position_weights, o.dpace_alpha) == ("gamma", 0.5)  # the default: the fixed decay, as before
    o = load_config(None, ["objective.position_weights=dpace", "objective.dpace_alpha=1"]).objective
    assert (o.position_weights, o.dpace_alpha) == ("dpace", 1.0)
    for override, said in [("objective.position_weights=decay", "objective.position_weights"),
                           ("objective.dpace_alpha=0", r"objective.dpace_alpha'.*\(0, 1\]"),
                           ("objective.dpace_alpha=1.5", "objective.dpace_alpha"),
                           ("objective.dpace_alpha=nan", "objective.dpace_alpha")]:
        with pytest.raises(ConfigError, match=said):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="position_weights.*hard labels"):
        load_config(None, ["objective.position_weights=dpace", "objective.labels=target_soft"])
    load_config(None, ["objective.position_weights=dpace", "objective.labels=target_argmax"])


