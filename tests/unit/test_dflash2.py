"""DFlash 2 drafters (models/dflash2.py, training/selector.py): the step against a plain reference, its
memory bound, the metrics along the selector's path, the exact decoder, the export contract, the keys."""
from __future__ import annotations

import json
from dataclasses import replace

import helpers
import pytest
import torch
import torch.nn.functional as F
from drafter_batches import three_sequences
from probes import LargestWithVocab
from safetensors.torch import load_file

from dflash_dist.config import ConfigError, load_config
from dflash_dist.evaluation.reference import speculative_generate
from dflash_dist.evaluation.speculative import ContextDrafter, speculative, target_greedy
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.dflash2 import candidate_logits, unary_top_k, walk
from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.models.export import export_drafter
from dflash_dist.models.variants import VARIANTS
from dflash_dist.models.variants.dflash2_loss import _walked_rows
from dflash_dist.training.objective import block_labels, lm_head_loss
from dflash_dist.training.stats import StepStats

CPU = torch.device("cpu")
K, R = 5, 8
SPEC = helpers.tiny_spec(variant="dflash2", conv_group_size=8, selector_top_k=K, selector_rank=R,
                         output_multiplier=0.7, final_logit_softcapping=3.0)
B, V, H = SPEC.block_size, SPEC.vocab_size, SPEC.hidden_size


def trained_like(model: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """Random convolution and selector weights (an untrained one is the identity and the unary path)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "codebook" in name else 0.2))
                if name.endswith("base_kernel"):
                    p[:, 0] += 1.0
    return model


def make_model(spec=SPEC, seed=0):
    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    model.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    return trained_like(model, seed)


@pytest.fixture(scope="module")
def batch():
    return three_sequences(V, 2 * H)


def reference(model, data, feats, anchors, anchor_cu, alpha):
    """The plain computation: whole logits, torch.topk over the vocabulary, every score spelled out."""
    s = model.spec
    labels, weights = block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu, B, 7.0)
    hidden = model.draft_hidden(model.context(feats), data.input_ids, data.position_ids, anchors,
                                data.cu_seqlens[:-1].repeat_interleave(anchor_cu[1:] - anchor_cu[:-1]))
    logits = model.lm_head(hidden)  # (A, B, V)
    valid = labels >= 0
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none").view_as(labels)
    unary_loss = (ce * weights).sum()
    served = logits.topk(K, dim=-1).indices  # (A, B, K)
    def capped(z):
        return torch.tanh(z * s.options.output_multiplier / s.options.final_logit_softcapping) * s.options.final_logit_softcapping

    sel = model.candidate_selector
    proj = sel.hidden_projection(hidden)  # (A, B, R)
    A = anchors.numel()
    sel_loss, hits, unary_hits, accept = 0.0, torch.zeros(B), torch.zeros(B), 0.0
    for j in range(A):
        prev_path, run_on = int(data.input_ids[anchors[j]]), True
        for k in range(1, B):
            gold_prev = int(data.input_ids[anchors[j] + k - 1]) if k == 1 or not valid[j, k - 1] else int(labels[j, k - 1])
            cands = served[j, k].tolist()
            if valid[j, k]:
                gold = int(labels[j, k])
                loss_cands = cands if gold in cands else cands[:-1] + [gold]
                score = torch.stack([capped(logits[j, k, b]) + (sel.predecessor_codebook[gold_prev] * proj[j, k])
                                     @ sel.successor_codebook[b] for b in loss_cands])
                sel_loss = sel_loss + weights[j, k] * -torch.log_softmax(score, 0)[loss_cands.index(gold)]
            with torch.no_grad():  # the greedy walk: the predecessor is the walk's own previous pick
                path_scores = [capped(logits[j, k, b]) + (sel.predecessor_codebook[prev_path] * proj[j, k])
                               @ sel.successor_codebook[b] for b in cands]
                prev_path = cands[int(torch.stack(path_scores).argmax())]
                hit = bool(valid[j, k]) and prev_path == int(labels[j, k])
                hits[k] += hit
                unary_hits[k] += bool(valid[j, k]) and int(logits[j, k].argmax()) == int(labels[j, k])
                run_on = run_on and hit
                accept += run_on
    return unary_loss + alpha * sel_loss, sel_loss, hits, unary_hits, accept + A


@pytest.mark.parametrize("anchor_chunk, loss_rows, detach", [(0, 8192, False), (4, 3, False), (1, 5, True)])
def test_dflash2_step_equals_the_plain_reference(batch, anchor_chunk, loss_rows, detach):
    data, feats, anchors, anchor_cu = batch
    model, alpha = make_model(), 0.6
    names, params = zip(*model.named_parameters())
    loss, sel_loss, hits, unary_hits, accept = reference(model, data, feats, anchors, anchor_cu, alpha)
    # The step's mean (its default): the sums over the batch's weight sum, as test_step compares them.
    norm = 1.0 / float(block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu, B, 7.0)[1].sum())
    loss, sel_loss = loss * norm, sel_loss * norm
    full = torch.autograd.grad(loss, params, retain_graph=True)
    unary_only = torch.autograd.grad(reference(model, data, feats, anchors, anchor_cu, 0.0)[0] * norm, params,
                                     allow_unused=True)
    # With detach the backbone sees the unary loss alone; the selector's own gradient is unchanged.
    want = {k: f if not detach or "candidate_selector" in k else u for k, f, u in zip(names, full, unary_only)}
    m = helpers.train_step(model, data, feats, None, anchors, anchor_cu, gamma=7.0, anchor_chunk=anchor_chunk,
                     loss_rows=loss_rows, selector_weight=alpha, selector_detach=detach)
    for k, p in model.named_parameters():
        # float32 rounding (~30 ulp of the tensor's largest entry): the chunked sums add in another order
        torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=4e-6 * float(want[k].abs().max()), msg=k)
    assert float(m.loss_sum) == pytest.approx(float(loss.detach()) / norm, rel=1e-5)
    assert float(m.sums["selector_loss_sum"]) == pytest.approx(float(sel_loss.detach()) / norm, rel=1e-5)
    assert m.correct.tolist() == hits.tolist() and m.sums["unary_correct"].tolist() == unary_hits.tolist()
    assert float(m.accept_sum) == pytest.approx(accept)


def test_acc_and_tau_follow_the_selector_path_not_the_unary_head(batch):
    """A drafter overfit on the batch drafts well, and its walk and argmax differ: the step's acc@k and
    accepted lengths are the walk's, the unary head's come beside them (TorchSpec 177)."""
    data, feats, anchors, anchor_cu = batch
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(40):
        opt.zero_grad()
        helpers.train_step(model, data, feats, None, anchors, anchor_cu, gamma=7.0, selector_weight=1.0)
        opt.step()
    _, _, hits, unary_hits, accept = reference(model, data, feats, anchors, anchor_cu, 1.0)
    m = helpers.train_step(model, data, feats, None, anchors, anchor_cu, gamma=7.0)
    assert m.correct.tolist() == hits.tolist() and m.sums["unary_correct"].tolist() == unary_hits.tolist()
    assert float(m.accept_sum) == pytest.approx(accept)
    assert hits.sum() > 0 and hits.tolist() != unary_hits.tolist()


@pytest.mark.parametrize("rows, kind", [(8192, "data"), (7, "data"), (5, "soft"), (3, "dpace")])
def test_the_loss_top_k_is_unary_top_k(rows, kind):
    """The candidates `lm_head_loss(top_k=K)` reads off its own logits are `unary_top_k`'s ids at the rows
    with a label (random float32 logits: no ties), in any row chunks and whatever the loss; their logits
    and the label's are the head's (to float32 rounding: a matmul against a gather's dot products)."""
    gen = torch.Generator().manual_seed(rows)
    A, Bk, Vk, Hk = 9, 6, 300, 24
    hidden, head = torch.randn(A, Bk, Hk, generator=gen), torch.randn(Vk, Hk, generator=gen)
    labels = torch.randint(0, Vk, (A, Bk), generator=gen)
    labels[torch.rand(A, Bk, generator=gen) < 0.3] = -100
    labels[:, 0] = -100
    weights = (labels >= 0).float()
    soft = None
    if kind == "soft":
        soft = (torch.softmax(torch.randn(A, Bk, 3, generator=gen), -1), torch.randint(0, Vk, (A, Bk, 3), generator=gen))
    loss, m, top = lm_head_loss(hidden.requires_grad_(), head, labels, weights, soft, rows=rows, top_k=K,
                                dpace_alpha=0.5 if kind == "dpace" else None)
    flat = hidden.detach().reshape(-1, Hk)
    sel = torch.nonzero(labels.reshape(-1) >= 0).squeeze(1)
    assert torch.equal(top.ids, unary_top_k(flat[sel], head, K, rows))
    assert torch.equal(top.ids, unary_top_k(flat, head, K)[sel])  # other row chunks: the same ids
    torch.testing.assert_close(top.logits, candidate_logits(flat[sel], head, top.ids), rtol=1e-5, atol=1e-5)
    lab = labels.reshape(-1)[sel]
    torch.testing.assert_close(top.label_logits, candidate_logits(flat[sel], head, lab[:, None])[:, 0],
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(lm_head_loss(hidden, head, labels, weights, soft, rows=rows,
                                    dpace_alpha=0.5 if kind == "dpace" else None)[0], loss)  # unchanged by it


def test_the_walk_passes_label_less_slots_before_a_label(batch):
    """A loss-mask gap inside a block: those slots' candidates come from their own head pass (the step's
    reference comparison then covers them); slots after a block's last label need none."""
    data, _, anchors, anchor_cu = batch
    labels, _ = block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu, B, 7.0)
    lab = labels[:, 1:]
    assert _walked_rows(lab).any() and _walked_rows(lab).sum() < (lab < 0).sum()
    lab = torch.tensor([[5, -100, 7, -100, -100], [-100, -100, 3, -100, -100], [-100] * 5])
    assert _walked_rows(lab).tolist() == [[False, True, False, False, False], [True, True, False, False, False],
                                          [False] * 5]


def test_the_greedy_path_is_the_walk_over_every_edge_score():
    """`greedy_path` (the training metrics' walk: the chosen predecessor's row only) drafts what `walk`
    over the whole K x K `edge_scores` drafts (the decoder's; random float32 scores: no ties)."""
    sel = make_model(seed=3).candidate_selector
    gen = torch.Generator().manual_seed(3)
    N, S = 40, 6
    cand = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(N * S)]).view(N, S, K)
    unary, hidden = torch.randn(N, S, K, generator=gen), torch.randn(N, S, H, generator=gen)
    anchors = torch.randint(0, V, (N,), generator=gen)
    with torch.no_grad():
        want = walk(sel.edge_scores(cand, unary, hidden, anchors), cand)
        path = sel.greedy_path(cand, unary, hidden, anchors)
    assert torch.equal(path, want) and (path != cand[:, :, 0]).any()  # not merely the unary argmax


def test_codebooks_and_top_k_never_build_rows_by_vocabulary(batch):
    data, feats, anchors, anchor_cu = batch
    rows = 3
    assert anchors.numel() * (B - 1) > 4 * rows
    model = make_model()
    with LargestWithVocab(V, model.lm_head.weight) as probe:
        helpers.train_step(model, data, feats, None, anchors, anchor_cu, gamma=7.0, anchor_chunk=2, loss_rows=rows)
    assert probe.rows == rows


def test_an_untrained_dflash2_drafter_is_its_dflash_backbone(batch):
    """Identity convolutions and a zero successor codebook: the same hidden states and drafted tokens as
    the DFlash drafter with the same backbone weights."""
    data, feats, anchors, anchor_cu = batch
    torch.manual_seed(3)
    d2 = DFlashDrafter(SPEC)
    d1 = DFlashDrafter(replace(SPEC, variant="dflash"))
    missing = d2.load_state_dict(d1.state_dict(), strict=False).missing_keys
    assert missing and all("conv" in k or "candidate_selector" in k for k in missing)
    head = torch.nn.Linear(H, V, bias=False)
    for d in (d1, d2):
        d.attach_target_head(torch.nn.Embedding(V, H), head)
        d._embed.weight.data.copy_(torch.arange(V * H, dtype=torch.float32).view(V, H).sin())
    starts = data.cu_seqlens[:-1].repeat_interleave(anchor_cu[1:] - anchor_cu[:-1])
    h1, h2 = (d.draft_hidden(d.context(feats), data.input_ids, data.position_ids, anchors, starts) for d in (d1, d2))
    torch.testing.assert_close(h2, h1, rtol=0, atol=0)
    assert torch.equal(d2.block_tokens(h2, data.input_ids[anchors]), d1.block_tokens(h1, data.input_ids[anchors]))


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(overrides=["model.draft.variant=dflash2", "model.draft.num_layers=2", "objective.block_size=6",
                                 "variant.selector_top_k=6", "variant.selector_rank=16"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    return cfg, target, spec


def test_the_decoder_walks_the_selector_and_stays_exact(tiny):
    cfg, target, spec = tiny
    drafter = trained_like(build_drafter(spec, target, seed=2, device=CPU).eval(), seed=4)
    prompts = [list(range(3, 20)), [5, 9, 2, 77, 31, 8, 8, 100, 64]]
    walked_elsewhere = 0
    for p in prompts:
        ref_out, ref_acc = speculative_generate(target, drafter, p, 30)
        out = speculative(target, drafter, p, 30)
        assert out.tokens == ref_out == target_greedy(target, p, 30).tokens
        assert out.accepted == ref_acc
        cache = ContextDrafter(drafter, 64)
        feats, _ = target.capture(torch.tensor(p), torch.tensor([0, len(p)]), torch.arange(len(p)),
                                  list(spec.target_layer_ids))
        cache.add(feats[:-1])
        hidden = _block_hidden(drafter, feats, p)
        argmax = drafter.lm_head(hidden)[0, 1:].argmax(-1).tolist()
        walked_elsewhere += cache.propose(p) != argmax
    assert walked_elsewhere  # the proposals are the walk's, not the unary argmax


def _block_hidden(drafter, feats, seq):
    n = len(seq)
    ids = torch.tensor(seq)
    anchor = torch.tensor([n - 1])
    return drafter.draft_hidden(drafter.context(feats[:n]), ids, torch.arange(n), anchor, torch.zeros(1, dtype=torch.long))


# The z-lab fixture (z-lab/dflash tests/fixtures/dflash2-safetensors-header.json): per layer the DFlash
# layer's tensors plus these, and the selector's three tensors; its shapes, as functions of the config.
FIXTURE_LAYER_EXTRA = {"attention_conv.base_kernel": lambda s: [2, s.options.conv_kernel_size, s.hidden_size],
                       "attention_conv.kernel_projection.weight":
                           lambda s: [2 * s.options.conv_kernel_size * s.hidden_size // s.options.conv_group_size, s.hidden_size],
                       "mlp_conv.base_kernel": lambda s: [2, s.options.conv_kernel_size, s.hidden_size],
                       "mlp_conv.kernel_projection.weight":
                           lambda s: [2 * s.options.conv_kernel_size * s.hidden_size // s.options.conv_group_size, s.hidden_size]}
FIXTURE_SELECTOR = {"candidate_selector.hidden_projection.weight": lambda s: [s.options.selector_rank, s.hidden_size],
                    "candidate_selector.predecessor_codebook": lambda s: [s.vocab_size, s.options.selector_rank],
                    "candidate_selector.successor_codebook": lambda s: [s.vocab_size, s.options.selector_rank]}
FIXTURE_DFLASH_CONFIG = {"block_size", "conv_group_size", "conv_kernel_size", "final_logit_softcapping",
                         "mask_token_id", "output_multiplier", "selector_rank", "selector_top_k", "target_layer_ids"}


def test_export_writes_the_z_lab_dflash2_contract(tmp_path):
    """The fixture's shape scaled down: 5 layers, kv heads a quarter of the heads, group 16, top-16."""
    cfg = load_config(overrides=["model.draft.variant=dflash2", "model.draft.num_layers=5", "model.draft.num_heads=4",
                                 "model.draft.num_kv_heads=1", "objective.block_size=16",
                                 "variant.selector_rank=32", "variant.output_multiplier=0.196",
                                 "variant.final_logit_softcapping=20"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    drafter = trained_like(build_drafter(spec, target, seed=1, device=CPU))
    out = export_drafter(spec, drafter.state_dict(), tmp_path / "export", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"]
    assert set(conf["dflash_config"]) == FIXTURE_DFLASH_CONFIG
    assert conf["dflash_config"]["selector_top_k"] == 16 and conf["dflash_config"]["conv_group_size"] == 16
    assert conf["dflash_config"]["output_multiplier"] == 0.196 and conf["dflash_config"]["block_size"] == 16
    assert conf["layer_types"] == ["full_attention"] * 5 and conf["use_sliding_window"] is False
    tensors = load_file(str(out / "model.safetensors"))
    dflash = {k for k in DFlashDrafter(replace(spec, variant="dflash")).state_dict()}
    extra = {f"layers.{i}.{k}": f(spec) for i in range(5) for k, f in FIXTURE_LAYER_EXTRA.items()}
    extra.update({k: f(spec) for k, f in FIXTURE_SELECTOR.items()})
    assert set(tensors) == dflash | set(extra)
    assert {k: list(tensors[k].shape) for k in extra} == extra
    card = (out / "README.md").read_text()
    assert "DFlash2DraftModel" in card and '"num_speculative_tokens": 15' in card and "DFLASH" in card


def test_bad_dflash2_keys_name_the_key():
    with pytest.raises(ConfigError, match="model.draft.variant"):
        load_config(overrides=["model.draft.variant=dflash3"])
    for key, value in (("conv_group_size", 24), ("selector_top_k", 129)):
        cfg = load_config(overrides=["model.draft.variant=dflash2", f"variant.{key}={value}"])
        with pytest.raises(ConfigError, match=f"'variant.{key}'"):
            draft_spec(cfg, build_target(cfg, CPU))


def test_step_stats_carry_the_unary_figures_beside_the_selectors():
    """DFlash 2's declared sums ride through the stats' packing (what the drafters all-reduce) by name, and
    its figures are today's formulas: ratios over the drafting slots' labels, per block, per weight."""
    figures = VARIANTS["dflash2"].figures
    s = StepStats(block_size=3, loss_sum=5.0, weight_sum=2.0, accept_sum=7.0, blocks=4, correct=torch.tensor([0.0, 3, 2]),
                  valid=torch.tensor([0.0, 4, 4]), figures=figures,
                  sums={"unary_accept_sum": 6.0, "selector_loss_sum": 1.0, "unary_correct": torch.tensor([0.0, 2, 1]),
                        "topk_hits": torch.tensor([0.0, 4, 3])})
    back = StepStats.unpack(s.pack(CPU), 3, figures)
    assert back.accuracy() == [0.75, 0.5]
    assert VARIANTS["dflash2"].reported_figures(back) == {"unary_acc": 3 / 8, "unary_accept_len": 1.5,
                                                          "topk_recall": 7 / 8, "selector_loss": 0.5}
    # a step without blocks reports none of them; DFlash reports none at all
    assert VARIANTS["dflash2"].reported_figures(StepStats.unpack(StepStats(3, figures=figures).pack(CPU), 3,
                                                                 figures)) == {}
    assert VARIANTS["dflash"].reported_figures(StepStats.unpack(StepStats(3, blocks=4).pack(CPU), 3)) == {}


def test_the_forecast_counts_dflash2_parameters_and_flops():
    """forecast/memory.py and cost.py (the parameters: test_variant_contract): the costs add the
    convolutions, the top-K read off the loss's logits (no second head pass) and the selector's scores,
    and nothing for a DFlash run."""
    from dflash_dist.forecast import cost as C
    from dflash_dist.forecast import memory as M
    from dflash_dist.forecast.shapes import model_shapes
    base, own = ["model.draft.num_layers=2"], {"dflash": [], "dflash2": ["variant.selector_rank=16"]}
    flops = {}
    for variant in ("dflash", "dflash2"):
        cfg = load_config(overrides=base + own[variant] + [f"model.draft.variant={variant}"])
        shapes = model_shapes(cfg)
        w = M.BatchShape(tokens=600, seqs=4, anchors=40, seq_lens=(150,) * 4, seq_anchors=(10,) * 4,
                         anchor_pos=tuple(range(5, 105, 10)) * 4)
        terms = C.drafter_terms(shapes, M.Precision(device="cpu"), cfg, w, 0).terms
        flops[variant] = terms
    extra = set(flops["dflash2"]) - set(flops["dflash"])
    assert extra == {"dflash2_conv", "selector_top_k", "selector_scores", "dflash2_conv_elementwise"}
    s, rows = model_shapes(cfg), 40 * (cfg.objective.block_size - 1)
    top_k = flops["dflash2"]["selector_top_k"]
    assert top_k.kind == "memory" and top_k.amount == rows * s.vocab * M.Precision(device="cpu").drafter_compute


@pytest.mark.parametrize("bf16", [False, True])
def test_the_memory_model_matches_a_dflash2_step_at_a_scaled_shape(bf16):
    """bench.memory's validation (test_memory's scaled shape and tolerance) with the DFlash 2 modules."""
    from dataclasses import dataclass

    from test_memory import SMALL

    import dflash_dist.bench.memory as BM

    @dataclass(frozen=True)
    class Scaled2(BM.Scaled):
        def overrides(self):
            return super().overrides() + ["model.draft.variant=dflash2"]

    v = BM.validate(Scaled2(**{**SMALL.__dict__, "bf16": bf16}), time_steps=False)
    ratios = {}
    for name in ("chunked", "unchunked"):
        ratios[name] = v[name]["predicted"] / v[name]["measured"]
        ratios[name + " saved"] = v[name]["saved_predicted"] / v[name]["saved_measured"]
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def test_a_dflash2_export_without_a_selector_key_is_named(tmp_path, tiny):
    from dflash_dist.evaluation.loading import read_export_config
    from dflash_dist.evaluation.prompts import EvalInputError
    cfg, target, spec = tiny
    out = export_drafter(spec, build_drafter(spec, target, seed=0, device=CPU).state_dict(), tmp_path / "e")
    conf = json.loads((out / "config.json").read_text())
    del conf["dflash_config"]["selector_rank"]
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(EvalInputError, match=r"config.json: missing dflash_config.selector_rank \(DFlash2DraftModel\)"):
        read_export_config(out)
