"""DSpark drafters (models/variants/dspark*.py): the anchor-as-first labels under the prefix rule, the
Markov walk, the step against a plain reference (whole logits, the loss spelled out), the target's final
hidden state in the features, the export contract and the exact decoders."""
from __future__ import annotations

import json
import math

import helpers
import pytest
import torch
import torch.nn.functional as F
from drafter_batches import three_sequences
from probes import LargestWithVocab
from safetensors.torch import load_file

from dflash_dist.config import ConfigError, load_config
from dflash_dist.data.collate import PackedBatch
from dflash_dist.evaluation.reference import speculative_generate
from dflash_dist.evaluation.speculative import speculative, target_greedy
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.models.export import export_config, export_drafter, serving_settings
from dflash_dist.models.variants.dspark_heads import markov_walk
from dflash_dist.parallel.transport import packet_spec
from dflash_dist.training.capture import capture_for_drafter
from dflash_dist.training.objective import block_labels

CPU = torch.device("cpu")
SPEC = helpers.tiny_spec(variant="dspark", markov_rank=6, confidence_head_with_markov=True)
B, V, H = SPEC.block_size, SPEC.vocab_size, SPEC.hidden_size
NFEAT = len(SPEC.target_layer_ids)


def make_model(spec=SPEC, seed=0) -> DFlashDrafter:
    """Random Markov and confidence weights (an untrained W2 is zero: the backbone's logits)."""
    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    model.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def batch():
    return three_sequences(V, (NFEAT + 1) * H)


def test_labels_anchor_as_first_under_the_prefix_rule():
    ids = torch.arange(10)
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    cu, anchors, anchor_cu = torch.tensor([0, 8, 10]), torch.tensor([0, 5, 8]), torch.tensor([0, 2, 3])
    labels, weights = block_labels(ids, mask, cu, anchors, anchor_cu, 4, 4.0, anchor_drafts=True, prefix=True)
    # anchor 0: 1, 2, then 3 is unsupervised: it and every slot after it untrained (4 is supervised);
    # anchor 5: 6, 7, then past its sequence's end (8); anchor 8: 9, then the batch's end.
    assert labels.tolist() == [[1, 2, -100, -100], [6, 7, -100, -100], [9, -100, -100, -100]]
    decay = [math.exp(-k / 4.0) for k in range(4)]
    torch.testing.assert_close(weights, torch.tensor([decay[:2] + [0, 0], decay[:2] + [0, 0], decay[:1] + [0] * 3]))
    # DFlash's rule is the default and stays as it was: slot k on anchor + k, slot 0 untrained, gaps kept.
    d_labels, _ = block_labels(ids, mask, cu, anchors, anchor_cu, 4, 4.0)
    assert d_labels.tolist() == [[-100, 1, 2, -100], [-100, 6, 7, -100], [-100, 9, -100, -100]]


def test_the_walk_biases_each_slot_by_the_token_drafted_before_it():
    model = make_model()
    hidden, anchor_ids = torch.randn(3, B, H), torch.tensor([4, 7, 11])
    got = markov_walk(model, hidden, anchor_ids)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    for n in range(3):
        prev = int(anchor_ids[n])
        for k in range(B):
            prev = int((model.lm_head(hidden[n, k]) + w2 @ w1[prev]).argmax())
            assert int(got[n, k]) == prev
    assert model.block_tokens(hidden, anchor_ids).shape == (3, B)  # B drafts: every slot's


def reference(model, data, feats, anchors, anchor_cu, gamma=4.0, a=0.1, b=0.9, c=1.0):
    """The plain loss: whole logits (A, B, V), every term written out, summed over the trained slots."""
    labels, weights = block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu, B, gamma,
                                   anchor_drafts=True, prefix=True)
    starts = data.cu_seqlens[:-1].repeat_interleave(anchor_cu[1:] - anchor_cu[:-1])
    hidden = model.draft_hidden(model.context(feats), data.input_ids, data.position_ids, anchors, starts)
    pos = (anchors[:, None] + torch.arange(B)).clamp(max=data.input_ids.numel() - 1)
    e = model.markov_head.markov_w1(data.input_ids[pos])  # prev_k: the data token at anchor + k
    z = model.lm_head(hidden) + e @ model.markov_head.markov_w2.weight.T
    p = torch.softmax(z, -1)
    p_t = torch.softmax(model.lm_head(feats[pos, -H:]), -1)
    l1 = (p - p_t).abs().sum(-1)
    ce = F.cross_entropy(z.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none").view_as(labels)
    conf = torch.sigmoid(model.confidence_head.proj(torch.cat([hidden, e], -1)).squeeze(-1))
    bce = F.binary_cross_entropy(conf, (1 - l1 / 2).detach(), reduction="none")
    loss = (weights * (a * ce + b * l1 + c * bce)).sum()
    valid = labels >= 0
    hit = (z.argmax(-1) == labels) & valid
    accept = (torch.cumprod(hit.long(), 1).sum(1) + 1).sum()
    return loss, weights.sum(), hit.sum(0), float(accept)


@pytest.mark.parametrize("anchor_chunk, loss_rows", [(0, 8192), (4, 3), (1, 5)])
def test_dspark_step_equals_the_plain_reference(batch, anchor_chunk, loss_rows):
    data, feats, anchors, anchor_cu = batch
    model = make_model()
    names, params = zip(*model.named_parameters())
    loss, wsum, hits, accept = reference(model, data, feats, anchors, anchor_cu)
    want = dict(zip(names, torch.autograd.grad(loss / wsum, params)))
    m = helpers.train_step(model, data, feats, None, anchors, anchor_cu, anchor_chunk=anchor_chunk, loss_rows=loss_rows)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=4e-6 * float(want[k].abs().max()), msg=k)
    assert float(m.loss_sum) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(m.weight_sum) == pytest.approx(float(wsum), rel=1e-6)
    assert m.correct.tolist() == hits.tolist() and float(m.accept_sum) == pytest.approx(accept)


def test_no_rows_x_vocabulary_tensor_outlives_a_row_chunk(batch):
    data, feats, anchors, anchor_cu = batch
    model = make_model()
    probe = LargestWithVocab(V, model.lm_head.weight, model.markov_head.markov_w2.weight)
    with probe:
        helpers.train_step(model, data, feats, None, anchors, anchor_cu, loss_rows=5)
    assert probe.rows == 5 and int((block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu,
                                                 B, 4.0, anchor_drafts=True)[0] >= 0).sum()) > 5


def test_the_loss_coefficients_and_gamma_are_the_objectives(batch):
    data, feats, anchors, anchor_cu = batch
    model = make_model()
    loss, wsum, _, _ = reference(model, data, feats, anchors, anchor_cu, gamma=2.0, a=0.5, b=0.0, c=2.0)
    m = helpers.train_step(model, data, feats, None, anchors, anchor_cu, gamma=2.0, ce_weight=0.5,
                           l1_weight=0.0, confidence_weight=2.0)
    assert float(m.loss_sum) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(m.weight_sum) == pytest.approx(float(wsum), rel=1e-6)


def test_the_features_end_with_the_targets_final_hidden_state():
    """lm_head of the captured post-norm last hidden state is the target's own logits, and the packet's
    width counts that one more block."""
    cfg = load_config(overrides=["model.draft.variant=dspark"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    gen = torch.Generator().manual_seed(3)
    ids, cu = torch.randint(0, target.vocab_size, (30,), generator=gen), torch.tensor([0, 12, 30])
    data = PackedBatch(ids, torch.ones(30, dtype=torch.bool), cu)
    feats, _ = capture_for_drafter(target, data, spec.target_layer_ids, cfg.objective, torch.float32, True)
    plain, logits = target.capture(ids, cu, data.position_ids, list(spec.target_layer_ids), need_logits=True)
    H_t = target.hidden_size
    assert feats.shape[1] == packet_spec(cfg, spec, CPU).feat_dim == (len(spec.target_layer_ids) + 1) * H_t
    torch.testing.assert_close(feats[:, :-H_t], plain)
    torch.testing.assert_close(target.lm_head(feats[:, -H_t:]), logits, rtol=1e-6, atol=1e-6)


def test_dspark_refuses_what_it_cannot_train():
    for bad in ("objective.labels=target_argmax", "objective.position_weights=dpace"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(overrides=["model.draft.variant=dspark", bad])


def test_the_export_is_vllms_qwen3_dspark_contract(tmp_path):
    model = make_model()
    out = export_drafter(SPEC, model.state_dict(), tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == B
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"],
            cfg["confidence_head_with_markov"]) == (6, "vanilla", True, True)
    assert cfg["mask_token_id"] == SPEC.mask_token_id == cfg["dflash_config"]["mask_token_id"]
    assert cfg["target_layer_ids"] == list(SPEC.target_layer_ids) and cfg["sample_from_anchor"] is True
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == tensors["markov_head.markov_w2.weight"].shape == (V, 6)
    assert tensors["confidence_head.proj.weight"].shape == (1, H + 6) and tensors["confidence_head.proj.bias"].shape == (1,)
    assert tensors["confidence_head.proj.weight"].dtype == torch.float32 == tensors["confidence_head.proj.bias"].dtype
    assert tensors["markov_head.markov_w1.weight"].dtype == torch.bfloat16
    vllm = serving_settings(SPEC)["vllm"]["speculative_config"]
    assert (vllm["method"], vllm["num_speculative_tokens"]) == ("dspark", B)
    no_conf = export_config(helpers.tiny_spec(variant="dspark", enable_confidence_head=False))
    assert no_conf["enable_confidence_head"] is False
    assert "confidence_head.proj.weight" not in DFlashDrafter(helpers.tiny_spec(
        variant="dspark", enable_confidence_head=False)).state_dict()


def test_both_decoders_are_exact_and_agree_step_for_step():
    cfg = load_config(overrides=["model.draft.variant=dspark", "objective.block_size=4"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    drafter = build_drafter(spec, target, seed=0, device=CPU)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 2.0)  # a bias that changes the drafts
    prompt = torch.randint(0, target.vocab_size - 1, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    want = target_greedy(target, prompt, 24).tokens
    got = speculative(target, drafter, prompt, 24)
    ref_tokens, ref_accepted = speculative_generate(target, drafter, prompt, 24)
    assert got.tokens == want == ref_tokens
    assert got.accepted == ref_accepted and max(got.accepted) <= spec.block_size + 1


@pytest.mark.parametrize("with_markov", [True, False])
def test_the_forecasts_count_the_heads_and_the_final_hidden_row(with_markov):
    """forecast/memory.py and cost.py (the parameters: test_variant_contract): the features carry
    the final hidden state as packet_spec sends it (one more H-wide block on the wire and in the drafter's
    packets); the target runs to its final norm; the costs add the teacher's head, the Markov products
    and the second (rows, V) buffer. At Qwen3-8B (V 151,936, r 256) the Markov head is 77.8M parameters."""
    from dflash_dist.forecast import cost as C
    from dflash_dist.forecast import memory as M
    from dflash_dist.forecast import variants as FV
    from dflash_dist.forecast.shapes import model_shapes
    base, own = ["model.draft.num_layers=2"], ["variant.markov_rank=8",
                                               f"variant.confidence_head_with_markov={str(with_markov).lower()}"]
    prec, terms, mem, tmem = M.Precision(device="cpu"), {}, {}, {}
    w = M.BatchShape(tokens=600, seqs=4, anchors=40, seq_lens=(150,) * 4, seq_anchors=(10,) * 4,
                     anchor_pos=tuple(range(5, 105, 10)) * 4)
    for variant in ("dflash", "dspark"):
        cfg = load_config(overrides=base + (own if variant == "dspark" else []) + [f"model.draft.variant={variant}"])
        target = build_target(cfg, CPU)
        spec = draft_spec(cfg, target)
        shapes = model_shapes(cfg)
        assert M.feature_blocks(shapes, cfg) * spec.hidden_size == packet_spec(cfg, spec, CPU).feat_dim
        assert M.runs_whole_target(cfg) == (variant == "dspark")
        terms[variant] = C.drafter_terms(shapes, prec, cfg, w, 0).terms
        mem[variant] = M.drafter_terms(shapes, prec, cfg, w, 0)
        tmem[variant] = M.target_terms(shapes, prec, cfg, w)
    assert set(terms["dspark"]) - set(terms["dflash"]) == {"dspark_teacher_head", "dspark_markov",
                                                          "dspark_teacher_softmax"}
    assert mem["dspark"]["packets"] > mem["dflash"]["packets"]
    assert mem["dspark"]["transient"] > mem["dflash"]["transient"]  # two float32 (rows, V) buffers
    assert tmem["dspark"]["packets"] > tmem["dflash"]["packets"]
    cfg8 = load_config("configs/qwen3_8b.yaml", ["model.draft.variant=dspark"])
    s8 = model_shapes(cfg8, "qwen3-8b")
    markov = 2 * 151936 * 256
    assert round(markov / 1e6, 1) == 77.8
    assert FV.forecast_of(cfg8).params(s8, cfg8) == markov + 4096 + 1  # the confidence head on h (the default)
