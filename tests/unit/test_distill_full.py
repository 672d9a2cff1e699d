"""objective.labels=target_full: distillation from the target's whole next-token distribution (forward KL
and the L1 distance), computed by the drafter in the loss's row chunks from the target's final-normed
last hidden state, which the packet carries as one more feature block."""
from __future__ import annotations

import helpers
import pytest
import torch
from oracles import full_distill_loss
from probes import LargestOutput

from dflash_dist.config import ConfigError, load_config
from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.variants import check_objective
from dflash_dist.parallel.transport import packet_spec, sends_final_hidden, target_label_width
from dflash_dist.training.capture import capture_for_drafter
from dflash_dist.training.objective import (
    FullTarget,
    anchor_generator,
    block_labels,
    draw_anchors,
    head_loss,
    label_positions,
    lm_head_loss,
)

CPU = torch.device("cpu")
A, B, H, V, N = 7, 6, 16, 300, 60


def batch(seed: int = 0):
    """hidden (A, B, H) requiring grad, head (V, H), labels/weights of `block_labels`, the target's final
    states (N, H) and the DFlash positions of each slot's distribution."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) > 0.2
    cu = torch.tensor([0, 25, 38, N])
    anchors = torch.tensor([0, 4, 11, 19, 25, 30, 55])  # 19 and 30 run past their sequence; 55 past the end
    anchor_cu = torch.tensor([0, 4, 6, 7])
    labels, weights = block_labels(ids, mask, cu, anchors, anchor_cu, B, gamma=4.0)
    hidden = torch.randn(A, B, H, generator=g).requires_grad_()
    head = torch.randn(V, H, generator=g) * H ** -0.5
    last = torch.randn(N, H, generator=g)
    return hidden, head, labels, weights, last, label_positions(anchors, B, N)


@pytest.mark.parametrize("kl,l1", [(1.0, 0.0), (0.0, 1.0), (0.7, 0.3)])
@pytest.mark.parametrize("rows", [1, 8, 13, 1000])  # 30-odd labelled rows: chunks that do not divide them, one chunk
def test_chunked_loss_gradient_and_metrics_equal_the_full_vocabulary_computation(kl, l1, rows):
    hidden, head, labels, weights, last, pos = batch()
    assert 0 < (labels >= 0).sum() < A * (B - 1)  # some slots have no label and are skipped
    want, ref, top1 = full_distill_loss(hidden @ head.T, last[pos] @ head.T, labels, weights, kl, l1)
    (want_grad,) = torch.autograd.grad(want, hidden)
    loss, m, _, counted = head_loss(hidden, head, labels, weights, rows=rows, full=FullTarget(last, pos, kl, l1))
    (grad,) = torch.autograd.grad(loss, hidden)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert grad[:, 0].abs().sum() == 0 and grad.abs().sum() > 0  # slot 0 never counts; the rest do
    assert torch.equal(counted, top1) and not torch.equal(top1, labels)  # the target's top-1, not the data's
    assert float(m.loss_sum) == pytest.approx(ref.loss_sum, rel=1e-5)
    assert float(m.weight_sum) == pytest.approx(ref.weight_sum, rel=1e-6)
    assert torch.equal(m.correct, ref.correct) and torch.equal(m.valid, ref.valid)
    assert float(m.accept_sum) == ref.accept_sum and m.num_blocks == A


def test_a_drafter_equal_to_the_target_has_nothing_to_learn_and_a_weight_scales_its_term():
    hidden, head, labels, weights, last, pos = batch(1)
    same = last[pos].clone().requires_grad_()  # the drafter's states are the target's at every slot
    loss, m = lm_head_loss(same, head, labels, weights, rows=5, full=FullTarget(last, pos, 1.0, 1.0))
    (grad,) = torch.autograd.grad(loss, same)
    assert abs(float(loss.detach())) < 1e-5 and grad.abs().max() < 1e-5
    assert torch.equal(m.correct, m.valid)  # its argmax is the target's top-1 at every trained slot
    one, _ = lm_head_loss(hidden, head, labels, weights, rows=5, full=FullTarget(last, pos, 1.0, 0.0))
    three, _ = lm_head_loss(hidden, head, labels, weights, rows=5, full=FullTarget(last, pos, 3.0, 0.0))
    assert float(one.detach()) > 0 and float(three.detach()) == pytest.approx(3 * float(one.detach()), rel=1e-6)


def test_the_top_k_label_logit_is_the_targets_top1_and_the_refusals():
    hidden, head, labels, weights, last, pos = batch(2)
    full = FullTarget(last, pos, 1.0, 0.5)
    _, _, top, counted = head_loss(hidden, head, labels, weights, rows=7, top_k=3, full=full)
    logits = (hidden @ head.T).detach()
    trained = labels >= 0
    torch.testing.assert_close(top.label_logits, logits[trained].gather(1, counted[trained][:, None])[:, 0])
    torch.testing.assert_close(top.logits, logits[trained].topk(3).values)
    with pytest.raises(ValueError, match="D-PACE"):
        lm_head_loss(hidden, head, labels, weights, dpace_alpha=0.5, full=full)
    with pytest.raises(ValueError, match="two label modes"):
        lm_head_loss(hidden, head, labels, weights, soft=(torch.ones(A, B, 1), torch.zeros(A, B, 1, dtype=torch.long)),
                     full=full)


def test_nothing_vocabulary_sized_is_saved_and_at_most_rows_of_logits_live():
    hidden, head, labels, weights, last, pos = batch()
    labelled = int((labels >= 0).sum())
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    rows = 8
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), LargestOutput() as probe:
        loss, _ = lm_head_loss(hidden, head, labels, weights, rows=rows, full=FullTarget(last, pos, 1.0, 1.0))
        loss.backward()
    assert saved and all(V not in t.shape for t in saved)
    assert sum(t.numel() for t in saved) <= labelled * H + labelled  # the (rows, H) gradient and its index
    assert probe.largest == rows * V


def test_the_distribution_of_slot_k_is_read_where_its_label_is_predicted():
    """DFlash: slot k's label is the token at anchor + k, so the target's distribution for it is its
    state at anchor + k - 1; anchor as first (DSpark's layout): the label is at anchor + k + 1, so anchor + k."""
    anchors = torch.tensor([0, 5, 9])
    assert label_positions(anchors, 4, 11).tolist() == [[0, 0, 1, 2], [4, 5, 6, 7], [8, 9, 10, 10]]
    assert label_positions(anchors, 4, 11, anchor_drafts=True).tolist() == [[0, 1, 2, 3], [5, 6, 7, 8],
                                                                            [9, 10, 10, 10]]


def test_the_packet_carries_the_final_state_and_the_step_trains_on_its_distribution():
    """End to end in one process: the capture sends the target's final-normed state as one more block
    (packet_spec's width, no predictions), and the drafter step's loss is the oracle's on the drafter's
    own states and the target's logits at anchor + k - 1, KL and L1 weighted by the keys."""
    cfg = load_config(overrides=["objective.labels=target_full", "objective.distill_kl_weight=0.8",
                                 "objective.distill_l1_weight=0.5", "objective.block_size=4"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    gen = torch.Generator().manual_seed(4)
    n, cu = 40, torch.tensor([0, 17, 40])
    ids = torch.randint(0, target.vocab_size - 1, (n,), generator=gen)
    data = PackedBatch(ids, torch.rand(n, generator=gen) > 0.2, cu)
    feats, labels_sent = capture_for_drafter(target, data, spec.target_layer_ids, cfg.objective, torch.float32)
    ps = packet_spec(cfg, spec, CPU)
    Ht = target.hidden_size
    assert labels_sent is None and ps.label_width == 0 and not ps.soft
    assert feats.shape[1] == ps.feat_dim == (len(spec.target_layer_ids) + 1) * Ht
    _, logits = target.capture(ids, cu, data.position_ids, list(spec.target_layer_ids), need_logits=True)
    torch.testing.assert_close(target.lm_head(feats[:, -Ht:]), logits, rtol=1e-5, atol=1e-5)

    model = build_drafter(spec, target, seed=0, device=CPU)
    anchors, anchor_cu = draw_anchors(data.loss_mask, cu, 5, anchor_generator(0, 0, 0))
    m = helpers.train_step(model, data, feats, None, anchors, anchor_cu, gamma=3.0, loss_rows=7,
                           labels="target_full", distill_kl_weight=0.8, distill_l1_weight=0.5)
    with torch.no_grad():
        hidden = model.draft_hidden(model.context(feats), ids, data.position_ids, anchors,
                                    torch.repeat_interleave(cu[:-1], anchor_cu[1:] - anchor_cu[:-1]))
    labels, weights = block_labels(ids, data.loss_mask, cu, anchors, anchor_cu, 4, 3.0)
    pos = anchors[:, None] + torch.arange(4) - 1
    want, ref, _ = full_distill_loss(model.lm_head(hidden), logits[pos.clamp(min=0)], labels, weights, 0.8, 0.5)
    assert float(m.loss_sum) == pytest.approx(float(want), rel=1e-5)
    assert torch.equal(m.correct, ref.correct) and float(m.accept_sum) == ref.accept_sum


def test_the_forecasts_count_the_final_block_and_no_target_logits():
    from dflash_dist.forecast import cost as C
    from dflash_dist.forecast import memory as M
    from dflash_dist.forecast.shapes import model_shapes
    w = M.BatchShape(tokens=600, seqs=4, anchors=40, seq_lens=(150,) * 4, seq_anchors=(10,) * 4,
                     anchor_pos=tuple(range(5, 105, 10)) * 4)
    prec, blocks, mem, cost, tgt = M.Precision(device="cpu"), {}, {}, {}, {}
    for labels in ("data", "target_argmax", "target_full"):
        cfg = load_config(overrides=[f"objective.labels={labels}"])
        target = build_target(cfg, CPU)
        spec = draft_spec(cfg, target)
        shapes = model_shapes(cfg)
        blocks[labels] = M.feature_blocks(shapes, cfg)
        assert blocks[labels] * spec.hidden_size == packet_spec(cfg, spec, CPU).feat_dim
        assert M.runs_whole_target(cfg) == (labels != "data")
        mem[labels] = M.drafter_terms(shapes, prec, cfg, w, 0)
        cost[labels] = C.drafter_terms(shapes, prec, cfg, w, 0).terms
        tgt[labels] = (M.target_terms(shapes, prec, cfg, w), C.target_terms(shapes, prec, cfg, w).terms)
    assert blocks["target_full"] == blocks["data"] + 1 == blocks["target_argmax"] + 1
    assert mem["target_full"]["packets"] > mem["data"]["packets"]
    assert mem["target_full"]["transient"] > mem["data"]["transient"]  # three float32 (rows, V) buffers
    assert set(cost["target_full"]) - set(cost["data"]) == {"distill_head", "distill_loss"}
    # The target computes no logits for target_full (the drafter does), unlike target_argmax.
    assert "distill" in tgt["target_argmax"][0] and "distill" not in tgt["target_full"][0]
    assert "lm_head" in tgt["target_argmax"][1] and "lm_head" not in tgt["target_full"][1]


def test_config_keys_and_the_one_rule_for_the_final_state():
    cfg = load_config(overrides=["objective.labels=target_full"])
    assert (cfg.objective.distill_kl_weight, cfg.objective.distill_l1_weight) == (1.0, 0.0)
    assert target_label_width("target_full", 8) == 0
    assert [sends_final_hidden(lab, False) for lab in ("data", "target_argmax", "target_soft", "target_full")] == \
        [False, False, False, True]
    assert sends_final_hidden("data", True)
    # the variants' one rule on loss weights (models.variants.check_objective, run right after loading)
    with pytest.raises(ConfigError, match="'objective.distill_kl_weight' and 'objective.distill_l1_weight'"):
        check_objective(load_config(overrides=["objective.labels=target_full", "objective.distill_kl_weight=0"]))
    check_objective(load_config(overrides=["objective.labels=target_full", "objective.distill_kl_weight=0",
                                           "objective.distill_l1_weight=0.5"]))  # the L1 term alone trains
    check_objective(load_config(overrides=["objective.distill_kl_weight=0"]))  # the keys only matter under target_full
    for bad in ("objective.distill_kl_weight=-1", "objective.distill_l1_weight=nan"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(overrides=["objective.labels=target_full", bad])
    with pytest.raises(ConfigError, match="objective.position_weights"):
        load_config(overrides=["objective.labels=target_full", "objective.position_weights=dpace"])
    with pytest.raises(ConfigError, match="'objective.labels': target_full with model.draft.variant=dspark"):
        load_config(overrides=["objective.labels=target_full", "model.draft.variant=dspark"])


def test_dflash2_trains_its_unary_head_on_the_distribution_and_its_selector_on_the_targets_top1():
    """DFlash 2 keeps the unary loss (`Needs.head_loss`): under target_full that loss is the
    distillation, and its selector's gold (the K-way cross-entropy, the top-K's recall) is the target's
    top-1 at each slot, as under target_soft, not the data's token."""
    cfg = load_config(overrides=["objective.labels=target_full", "objective.block_size=4",
                                 "model.draft.variant=dflash2", "variant.selector_top_k=8",
                                 "variant.selector_rank=16"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    gen = torch.Generator().manual_seed(6)
    n, cu = 40, torch.tensor([0, 23, 40])
    ids = torch.randint(0, target.vocab_size - 1, (n,), generator=gen)
    data = PackedBatch(ids, torch.rand(n, generator=gen) > 0.2, cu)
    feats, _ = capture_for_drafter(target, data, spec.target_layer_ids, cfg.objective, torch.float32)
    _, logits = target.capture(ids, cu, data.position_ids, list(spec.target_layer_ids), need_logits=True)
    model = build_drafter(spec, target, seed=0, device=CPU)
    anchors, anchor_cu = draw_anchors(data.loss_mask, cu, 5, anchor_generator(0, 0, 0))
    m = helpers.train_step(model, data, feats, None, anchors, anchor_cu, gamma=3.0, loss_rows=6,
                           labels="target_full", selector_weight=0.5)
    with torch.no_grad():
        hidden = model.draft_hidden(model.context(feats[:, :model.fc.in_features]), ids, data.position_ids,
                                    anchors, torch.repeat_interleave(cu[:-1], anchor_cu[1:] - anchor_cu[:-1]))
    labels, weights = block_labels(ids, data.loss_mask, cu, anchors, anchor_cu, 4, 3.0)
    pos = (anchors[:, None] + torch.arange(4) - 1).clamp(min=0)
    unary_logits = model.lm_head(hidden)
    want, ref, top1 = full_distill_loss(unary_logits, logits[pos], labels, weights, 1.0, 0.0)
    assert torch.equal(m.sums["unary_correct"], ref.correct)
    assert float(m.loss_sum) == pytest.approx(float(want) + 0.5 * float(m.sums["selector_loss_sum"]), rel=1e-5)
    trained = top1 >= 0
    hits = (unary_logits.topk(8, dim=-1).indices == top1[..., None]).any(-1) & trained
    data_hits = (unary_logits.topk(8, dim=-1).indices == labels[..., None]).any(-1) & trained
    assert torch.equal(m.sums["topk_hits"], hits.sum(0)) and not torch.equal(hits, data_hits)


def test_the_memory_model_matches_a_measured_target_full_step():
    """bench.memory's validation at the scaled shape test_memory uses (bf16 autocast, as on CUDA): the
    target's peak with the final-state block and the drafter's, whose loss chunk holds three float32
    (rows, V) buffers and the gradient's cast, within the band test_memory holds the other modes to."""
    from dataclasses import replace

    from test_memory import SMALL

    import dflash_dist.bench.memory as BM
    v = BM.validate(replace(SMALL, bf16=True, labels="target_full"), time_steps=False)
    ratios = {"target": v["target"]["predicted"] / v["target"]["measured"]}
    for name in ("chunked", "unchunked"):
        ratios[name] = v[name]["predicted"] / v[name]["measured"]
        ratios[name + " saved"] = v[name]["saved_predicted"] / v[name]["saved_measured"]
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios
