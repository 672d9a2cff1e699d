"""Domino drafters (models/variants/domino*.py): the GRU against torch's own, the rollout against the
teacher-forced head, the step against a plain reference (whole logits, torch's nn.GRU and embed_proj, the
loss spelled out), the lambda schedule, SGLang's export contract, the vLLM refusal and the exact decoders."""
from __future__ import annotations

import json
import logging
import math

import helpers
import pytest
import torch
import torch.nn.functional as F
from drafter_batches import three_sequences
from oracles import full_distill_loss
from probes import LargestWithVocab
from safetensors.torch import load_file

from dflash_dist.config import ConfigError, load_config
from dflash_dist.data.collate import PackedBatch
from dflash_dist.evaluation.reference import speculative_generate
from dflash_dist.evaluation.speculative import speculative, target_greedy
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.models.export import export_drafter, serving_settings
from dflash_dist.models.variants import RunProgress, variant_of_export
from dflash_dist.models.variants.domino_head import domino_rollout, prefix_states
from dflash_dist.models.variants.domino_loss import domino_lambda
from dflash_dist.parallel.transport import packet_spec
from dflash_dist.training.objective import block_labels
from dflash_dist.training.step import StepBatch, drafter_step, step_settings

CPU = torch.device("cpu")
G, E = 10, 6
SPEC = helpers.tiny_spec(variant="domino", gru_hidden_dim=G, emb_dim=E)
B, V, H = SPEC.block_size, SPEC.vocab_size, SPEC.hidden_size
NFEAT = len(SPEC.target_layer_ids)


def make_model(spec=SPEC, seed=0) -> DFlashDrafter:
    """Random head weights (an untrained W2 is zero: the backbone's logits)."""
    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    model.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    with torch.no_grad():
        model.embed_proj[2].weight.normal_(0, 0.5)
    return model


def oracle_logits(model, hidden, prev):
    """(A, B, V) the teacher-forced final logits written plainly: torch's nn.GRU over the previous tokens'
    embeddings (slot k's state after prev[:, :k + 1]), embed_proj as a module, slot 0 the base logits."""
    states, _ = model.prefix_gru(model._embed(prev))
    delta = model.embed_proj(torch.cat([hidden, states], dim=-1))
    delta = torch.cat([torch.zeros_like(delta[:, :1]), delta[:, 1:]], dim=1)
    return model.lm_head(hidden) + delta


@pytest.fixture(scope="module")
def batch():
    return three_sequences(V, NFEAT * H)


def test_the_gru_is_torchs_gru():
    """prefix_states computes the GRU from its two weights: the same as nn.GRU's forward (SGLang's)."""
    model = make_model()
    prev = torch.randint(0, V, (5, B))
    want, _ = model.prefix_gru(model._embed(prev))
    torch.testing.assert_close(prefix_states(model, prev), want, rtol=1e-5, atol=1e-6)


def test_the_state_dict_has_sglangs_names_and_shapes():
    shapes = {k: tuple(v.shape) for k, v in make_model().state_dict().items()
              if k.startswith(("prefix_gru.", "embed_proj."))}
    assert shapes == {"prefix_gru.weight_ih_l0": (3 * G, H), "prefix_gru.weight_hh_l0": (3 * G, G),
                      "embed_proj.0.weight": (E, H + G), "embed_proj.2.weight": (V, E)}
    assert not DFlashDrafter(SPEC).embed_proj[2].weight.any()  # untrained: the backbone's drafts


def test_the_rollout_fed_the_labels_is_the_teacher_forced_head():
    """(a) The sequential rollout, its GRU fed the data's tokens instead of its drafts, gives the logits
    the training head computes in parallel; fed its own drafts, each slot drafts its argmax."""
    model = make_model()
    hidden, prev = torch.randn(4, B, H), torch.randint(0, V, (4, B))
    tokens, logits = domino_rollout(model, hidden, prev[:, 0], forced=prev[:, 1:], keep_logits=True)
    with torch.no_grad():
        want = oracle_logits(model, hidden, prev)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, want.argmax(-1))
    drafts = model.block_tokens(hidden, prev[:, 0])
    assert drafts.shape == (4, B - 1)  # B - 1 drafts: SGLang's proposals, slots 0..B-2
    with torch.no_grad():
        own = oracle_logits(model, hidden, torch.cat([prev[:, :1], drafts], dim=1))[:, :-1]
    assert torch.equal(drafts, own.argmax(-1))
    assert not torch.equal(drafts, model.lm_head(hidden[:, :-1]).argmax(-1))  # the head changes the drafts


def test_labels_anchor_as_first_with_a_per_slot_mask():
    """Every slot whose token is inside the sequence and the loss mask trains (no prefix rule), exp(-k/7)."""
    ids = torch.arange(10)
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    cu, anchors, anchor_cu = torch.tensor([0, 8, 10]), torch.tensor([0, 5]), torch.tensor([0, 2, 2])
    settings = step_settings(helpers.config_of(block_size=4), SPEC)
    assert settings.gamma == 7.0
    from dflash_dist.training.step import batch_targets
    labels, weights, _ = batch_targets(PackedBatch(ids, mask, cu), None, anchors, anchor_cu, 4, settings.gamma,
                                       variant=SPEC.family)
    assert labels.tolist() == [[1, 2, -100, 4], [6, 7, -100, -100]]  # 3 unsupervised, 4 trained after it
    decay = [math.exp(-k / 7.0) for k in range(4)]
    torch.testing.assert_close(weights, torch.tensor([[decay[0], decay[1], 0, decay[3]], [decay[0], decay[1], 0, 0]]))


def domino_step(model, data, feats, anchors, anchor_cu, progress=RunProgress(), **objective):
    """drafter_step with the settings step_settings builds, loss_norm=batch (the mean over the weights)."""
    cfg = helpers.config_of(block_size=B, loss_norm="batch", **objective)
    return drafter_step(model, StepBatch(data, feats, None, anchors, anchor_cu, progress), step_settings(cfg, model.spec))


def reference(model, data, feats, anchors, anchor_cu, lam, gamma=7.0, full=None):
    """(d) The plain loss: whole logits (A, B, V) of the base head and the oracle's final head, both
    cross-entropies written out, weighted and summed over the trained slots; the final and the base
    logits' hits and accepted lengths. With `full` ((KL weight, L1
    weight): target_full) each cross-entropy is instead oracles.full_distill_loss against the whole
    softmax(lm_head(last[anchor + k])), `last` the features' final H columns, and the hits count against
    the target's top-1."""
    labels, weights = block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu, B, gamma,
                                   anchor_drafts=True)
    starts = data.cu_seqlens[:-1].repeat_interleave(anchor_cu[1:] - anchor_cu[:-1])
    hidden = model.draft_hidden(model.context(feats), data.input_ids, data.position_ids, anchors, starts)
    pos = (anchors[:, None] + torch.arange(B)).clamp(max=data.input_ids.numel() - 1)
    z = oracle_logits(model, hidden, data.input_ids[pos])  # the GRU over the data tokens at anchor + k
    b = model.lm_head(hidden)
    if full is None:
        tgt = labels.flatten().clamp(min=0)
        ce = F.cross_entropy(z.flatten(0, 1), tgt, reduction="none").view_as(labels)
        ce_b = F.cross_entropy(b.flatten(0, 1), tgt, reduction="none").view_as(labels)
        loss = (weights * ((1 - lam) * ce + lam * ce_b)).sum()
        counted = labels
    else:  # anchor as first: slot k drafts anchor + k + 1, which the target predicts from its state at anchor + k
        teacher = model.lm_head(feats[:, -H:][pos])
        final, _, counted = full_distill_loss(z, teacher, labels, weights, *full)
        base, _, _ = full_distill_loss(b, teacher, labels, weights, *full)
        loss = (1 - lam) * final + lam * base
    valid = labels >= 0

    def figures(logits):  # (hits per slot, the served drafts' accepted length summed over blocks)
        hit = (logits.argmax(-1) == counted) & valid
        served = hit[:, :-1]  # SGLang proposes slots 0..B-2: the accepted run ends there
        return hit.sum(0), float((torch.cumprod(served.long(), 1).sum(1) + 1).sum())
    return (loss, weights.sum(), *figures(z), *figures(b))


@pytest.mark.parametrize("anchor_chunk, loss_rows, step, total", [(0, 8192, 3, 10), (4, 3, 3, 10), (1, 5, 0, 10),
                                                                  (2, 7, 9, 10), (0, 4, 0, 0)])
def test_domino_step_equals_the_plain_reference(batch, anchor_chunk, loss_rows, step, total):
    """Chunked (anchors, rows) or not, at lambda 1, 0 and between: the loss, every gradient and the
    metrics are the reference's."""
    data, feats, anchors, anchor_cu = batch
    lam = domino_lambda(step, total, 1.0)
    model = make_model()
    names, params = zip(*model.named_parameters())
    loss, wsum, hits, accept, base_hits, base_accept = reference(model, data, feats, anchors, anchor_cu, lam)
    want = dict(zip(names, torch.autograd.grad(loss / wsum, params, allow_unused=True)))
    m = domino_step(model, data, feats, anchors, anchor_cu, RunProgress(step, total), anchor_chunk=anchor_chunk,
                    loss_rows=loss_rows)
    for k, p in model.named_parameters():
        if want[k] is None:  # lambda 1: no gradient reaches the GRU and the delta
            assert lam == 1.0 and (p.grad is None or not p.grad.any()), k
            continue
        torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=4e-6 * float(want[k].abs().max()), msg=k)
    assert float(m.loss_sum) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(m.weight_sum) == pytest.approx(float(wsum), rel=1e-6)
    assert m.correct.tolist() == hits.tolist() and float(m.accept_sum) == pytest.approx(accept)
    # the base logits' (the plain head's) figures beside, as the unary head's
    assert m.sums["unary_correct"].tolist() == base_hits.tolist() and float(m.sums["unary_accept_sum"]) == pytest.approx(base_accept)


def full_batch(batch):
    """The batch's features with the target's final state as one more H-wide block (`sends_final_hidden`):
    random rows, so the target's top-1 differs from the data's tokens."""
    data, feats, anchors, anchor_cu = batch
    last = torch.randn(feats.shape[0], H, generator=torch.Generator().manual_seed(5))
    return data, torch.cat([feats, last], dim=1), anchors, anchor_cu


@pytest.mark.parametrize("kl, l1", [(1.0, 0.0), (0.0, 1.0), (0.7, 0.3)])
@pytest.mark.parametrize("anchor_chunk, loss_rows, step, total", [(0, 8192, 3, 10), (4, 3, 3, 10), (1, 5, 0, 10),
                                                                  (2, 7, 9, 10), (0, 4, 0, 0)])
def test_target_full_step_equals_the_plain_full_vocabulary_reference(batch, anchor_chunk, loss_rows, step, total,
                                                                      kl, l1):
    """objective.labels=target_full: chunked (anchors, rows) or not, at lambda 1, 0 and between, KL, L1 or
    both: the loss, every gradient and the metrics (against the target's top-1) are the reference's."""
    data, feats, anchors, anchor_cu = full_batch(batch)
    lam = domino_lambda(step, total, 1.0)
    model = make_model()
    names, params = zip(*model.named_parameters())
    loss, wsum, hits, accept, base_hits, base_accept = reference(model, data, feats, anchors, anchor_cu, lam,
                                                                 full=(kl, l1))
    want = dict(zip(names, torch.autograd.grad(loss / wsum, params, allow_unused=True)))
    data_hits = reference(model, data, feats[:, :-H], anchors, anchor_cu, lam)[2]
    assert hits.tolist() != data_hits.tolist()  # the counted labels are the target's, not the data's
    m = domino_step(model, data, feats, anchors, anchor_cu, RunProgress(step, total), anchor_chunk=anchor_chunk,
                    loss_rows=loss_rows, labels="target_full", distill_kl_weight=kl, distill_l1_weight=l1)
    for k, p in model.named_parameters():
        if p.grad is None:  # lambda 1: nothing reaches the GRU and the delta
            assert lam == 1.0 and (want[k] is None or not want[k].any()), k
            continue
        torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=4e-6 * float(want[k].abs().max()), msg=k)
    assert model.lm_head.weight.grad is None  # the frozen head, the target's and the drafter's
    assert float(m.loss_sum) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(m.weight_sum) == pytest.approx(float(wsum), rel=1e-6)
    assert m.correct.tolist() == hits.tolist() and float(m.accept_sum) == pytest.approx(accept)
    # the base logits' (the plain head's) figures beside, as the unary head's
    assert m.sums["unary_correct"].tolist() == base_hits.tolist() and float(m.sums["unary_accept_sum"]) == pytest.approx(base_accept)


def test_target_full_trains_nothing_when_the_drafter_is_the_target(batch):
    """A drafter whose final and base logits are the target's at every slot (W2 zero, the states the
    target's) has a zero loss and gradient under KL and L1, and hits the target's top-1 everywhere."""
    from dflash_dist.models.variants.domino_loss import Distill, mixed_loss
    head = torch.randn(V, H)
    last = torch.randn(9, H)
    h = last.clone().requires_grad_()
    a = torch.randn(9, E, requires_grad=True)
    w2 = torch.zeros(V, E, requires_grad=True)
    loss, (pred, base, top1) = mixed_loss(h, a, w2, head, None, torch.rand(9) + 0.5, 0.3, 4, Distill(last, 1.0, 1.0))
    grads = torch.autograd.grad(loss, (h, a, w2))
    assert abs(float(loss.detach())) < 1e-5 and all(float(g.abs().max()) < 1e-5 for g in grads)
    assert torch.equal(pred, top1) and torch.equal(base, top1) and torch.equal(top1, (last @ head.T).argmax(-1))


def test_lambda_moves_the_gradient_between_the_heads(batch):
    """lambda 1 trains the base head alone (no gradient into W2), lambda 0 the final logits alone."""
    data, feats, anchors, anchor_cu = batch
    model = make_model()
    domino_step(model, data, feats, anchors, anchor_cu, RunProgress(0, 10))
    assert model.embed_proj[2].weight.grad is None or not model.embed_proj[2].weight.grad.any()
    model.zero_grad()
    domino_step(model, data, feats, anchors, anchor_cu, RunProgress(10, 10))
    assert model.embed_proj[2].weight.grad.abs().sum() > 0 and model.prefix_gru.weight_hh_l0.grad.abs().sum() > 0


def test_no_rows_x_vocabulary_tensor_outlives_a_row_chunk(batch):
    data, feats, anchors, anchor_cu = batch
    model = make_model()
    probe = LargestWithVocab(V, model.lm_head.weight, model.embed_proj[2].weight)
    with probe:
        domino_step(model, data, feats, anchors, anchor_cu, RunProgress(4, 10), loss_rows=5)
    trained = int((block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu, B, 7.0,
                                anchor_drafts=True)[0] >= 0).sum())
    assert probe.rows == 5 and trained > 5
    probe = LargestWithVocab(V, model.lm_head.weight, model.embed_proj[2].weight)
    with probe:  # target_full: the target's distribution too, in the same row chunks
        domino_step(model, *full_batch(batch), RunProgress(4, 10), loss_rows=5, labels="target_full",
                    distill_kl_weight=0.7, distill_l1_weight=0.3)
    assert probe.rows == 5


def test_the_lambda_schedule():
    """(e) Linear from 1 at the first step to 0 after floor(f * T) steps (SpecForge's linear_lambda_base),
    0 with no total known."""
    assert [domino_lambda(s, 10, 1.0) for s in (0, 1, 5, 9, 10, 12)] == [1.0, 0.9, 0.5, pytest.approx(0.1), 0.0, 0.0]
    assert [domino_lambda(s, 10, 0.5) for s in (0, 1, 4, 5, 9)] == [1.0, 0.8, pytest.approx(0.2), 0.0, 0.0]
    assert domino_lambda(0, 3, 0.1) == 1.0 and domino_lambda(1, 3, 0.1) == 0.0  # at least one step of decay
    assert domino_lambda(0, 0, 1.0) == 0.0


def test_the_run_passes_its_step_and_total():
    """roles/drafter.py: the coming step's progress is the checkpointed step count of the exact total (on
    the schedule clock: the identity in a run that was not resumed on another layout)."""
    from types import SimpleNamespace

    from dflash_dist.roles.drafter import Drafter
    from dflash_dist.training.state import ScheduleClock, TrainState
    state = SimpleNamespace(totals=SimpleNamespace(steps=7), clock=ScheduleClock(20, 20))
    state.progress = lambda steps: TrainState.progress(state, steps)
    assert Drafter.progress(SimpleNamespace(state=state, total_steps=20)) == RunProgress(7, 20)


def test_domino_config_keys_and_refusals():
    cfg = load_config(overrides=["model.draft.variant=domino"])
    assert (cfg.variant.gru_hidden_dim, cfg.variant.emb_dim, cfg.variant.lambda_fraction) \
        == (1024, 256, 1.0)
    full = load_config(overrides=["model.draft.variant=domino", "objective.labels=target_full", "objective.block_size=4"])
    assert step_settings(full, SPEC).full == (1.0, 0.0)  # the step takes it too: Domino's term distils
    for bad in ("objective.labels=target_argmax", "objective.labels=target_soft", "objective.position_weights=dpace",
                "variant.gru_hidden_dim=0", "variant.emb_dim=0", "variant.lambda_fraction=0",
                "variant.lambda_fraction=1.5"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(overrides=["model.draft.variant=domino", bad])


def test_the_export_is_sglangs_domino_contract(tmp_path):
    """(c) DFlashDraftModel with dflash_config.projector_type domino, the contract's keys and tensors
    (read back as Domino, to the same weights: test_variant_contract)."""
    model = make_model()
    out = export_drafter(SPEC, model.state_dict(), tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["emb_dim"] == E
    dc = cfg["dflash_config"]
    assert (dc["projector_type"], dc["gru_hidden_dim"], dc["emb_dim"], dc["shift_label"], dc["pure_draft_prefix_len"],
            dc["block_size"]) == ("domino", G, E, True, 1, B)
    tensors = load_file(str(out / "model.safetensors"))
    head = {k: tuple(v.shape) for k, v in tensors.items() if not k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}
    assert head == {"prefix_gru.weight_ih_l0": (3 * G, H), "prefix_gru.weight_hh_l0": (3 * G, G),
                    "embed_proj.0.weight": (E, H + G), "embed_proj.2.weight": (V, E)}
    assert serving_settings(SPEC)["vllm"] is None  # vLLM 0.32 cannot serve it
    assert "--speculative-algorithm DFLASH" in serving_settings(SPEC)["sglang"]["command"]
    bad = dict(cfg, dflash_config=dict(dc, shift_label=False))
    with pytest.raises(ValueError, match="shift_label"):
        variant_of_export(bad).spec_fields(bad)


def test_evaluate_with_vllm_refuses_a_domino_export(tmp_path, caplog):
    from dflash_dist.evaluate import main
    out = export_drafter(SPEC, make_model().state_dict(), tmp_path / "draft")
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        rc = main(["--draft", str(out), "--engine", "vllm"])
    err = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert rc == 2 and "Domino drafter" in err and "vLLM 0.32 cannot serve" in err, err


def test_both_decoders_are_exact_and_agree_step_for_step():
    """(b) The KV-cached decoder and the reference decoder, B drafts a block, equal the target's greedy."""
    cfg = load_config(overrides=["model.draft.variant=domino", "objective.block_size=4", "variant.gru_hidden_dim=16",
                                 "variant.emb_dim=8"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    drafter = build_drafter(spec, target, seed=0, device=CPU)
    with torch.no_grad():
        drafter.embed_proj[2].weight.normal_(0, 2.0)  # a delta that changes the drafts
    prompt = torch.randint(0, target.vocab_size - 1, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    want = target_greedy(target, prompt, 24).tokens
    got = speculative(target, drafter, prompt, 24)
    ref_tokens, ref_accepted = speculative_generate(target, drafter, prompt, 24)
    assert got.tokens == want == ref_tokens
    assert got.accepted == ref_accepted and max(got.accepted) <= spec.block_size + 1
    assert packet_spec(cfg, spec, CPU).feat_dim == len(spec.target_layer_ids) * spec.hidden_size  # no extra block


def test_the_forecasts_count_the_gru_and_the_delta():
    """(g) forecast/memory.py and cost.py (the parameters: test_variant_contract): the features are
    the captured layers' alone (no final hidden state on the wire); the costs add the GRU, the delta and
    the second (rows, V) buffer, the memory the GRU's and the delta's saved tensors. At Qwen3-8B (V 151,936,
    G 1024, E 256) the head is 55.9M parameters, W2 38.9M of them."""
    from dflash_dist.forecast import cost as C
    from dflash_dist.forecast import memory as M
    from dflash_dist.forecast import variants as FV
    from dflash_dist.forecast.shapes import model_shapes
    base, own = ["model.draft.num_layers=2"], ["variant.gru_hidden_dim=12", "variant.emb_dim=8"]
    prec, terms, mem = M.Precision(device="cpu"), {}, {}
    w = M.BatchShape(tokens=600, seqs=4, anchors=40, seq_lens=(150,) * 4, seq_anchors=(10,) * 4,
                     anchor_pos=tuple(range(5, 105, 10)) * 4)
    for variant in ("dflash", "domino"):
        cfg = load_config(overrides=base + (own if variant == "domino" else []) + [f"model.draft.variant={variant}"])
        target = build_target(cfg, CPU)
        spec = draft_spec(cfg, target)
        shapes = model_shapes(cfg)
        assert M.feature_blocks(shapes, cfg) * spec.hidden_size == packet_spec(cfg, spec, CPU).feat_dim
        assert not M.runs_whole_target(cfg)
        terms[variant] = C.drafter_terms(shapes, prec, cfg, w, 0).terms
        mem[variant] = M.drafter_terms(shapes, prec, cfg, w, 0)
    assert set(terms["domino"]) - set(terms["dflash"]) == {"domino_gru", "domino_delta", "domino_gru_elementwise",
                                                          "domino_final_softmax"}
    assert mem["domino"]["activations"] > mem["dflash"]["activations"]
    assert mem["domino"]["transient"] > mem["dflash"]["transient"]  # two float32 (rows, V) buffers
    # target_full: the target's final state on the wire, and two float32 (rows, V) more (p_t and a scratch)
    full = load_config(overrides=base + own + ["model.draft.variant=domino", "objective.labels=target_full"])
    assert M.feature_blocks(shapes, full) == M.feature_blocks(shapes, cfg) + 1 and M.runs_whole_target(full)
    with_full, plain = (FV.forecast_of(cfg).chunk_bytes(shapes, prec, c, 64, 400, 80).loss for c in (full, cfg))
    assert with_full - plain == 2 * 4 * 64 * shapes.vocab
    # its distillation runs on both logits while lambda is between 0 and 1: 1 + f passes a batch, DFlash's one
    dflash_full = load_config(overrides=base + ["objective.labels=target_full"])
    one = C.drafter_terms(shapes, prec, dflash_full, w, 0).terms["distill_loss"].amount
    for f in (1.0, 0.25):
        half = load_config(overrides=base + own + ["model.draft.variant=domino", "objective.labels=target_full",
                                             f"variant.lambda_fraction={f}"])
        assert C.drafter_terms(shapes, prec, half, w, 0).terms["distill_loss"].amount == pytest.approx((1 + f) * one)
    cfg8 = load_config("configs/qwen3_8b.yaml", ["model.draft.variant=domino"])
    s8 = model_shapes(cfg8, "qwen3-8b")
    head = 3 * 1024 * (4096 + 1024) + 256 * (4096 + 1024) + 151936 * 256
    assert (round(head / 1e6, 1), round(151936 * 256 / 1e6, 1)) == (55.9, 38.9)
    assert FV.forecast_of(cfg8).params(s8, cfg8) == head


def test_acceptance_counts_the_served_drafts_only():
    """Every slot right: a block accepts its B - 1 drafts and the bonus (B tokens, SGLang's most), not
    B + 1; the last slot's hits still count in its accuracy (it is trained)."""
    from dflash_dist.models.variants.domino import served_metrics
    labels = torch.arange(2 * B).view(2, B)
    correct, accept_sum = served_metrics(labels.clone(), labels)
    assert correct.tolist() == [2] * B and float(accept_sum) == 2 * B
    labels[1, 1] = -100  # an untrained slot ends that block's run: 1 draft + the bonus
    assert float(served_metrics(labels.clone(), labels)[1]) == B + 2
