"""DFlash 2 against its serving contract, vLLM 0.32's own code in the test venv, float32 on random inputs:
the grouped convolution (`_grouped_conv`), the layer's wrapping (`DFlash2Qwen3DecoderLayer.forward`),
the pair scores (`_score_edges`), the candidates (`LogitsProcessor.get_top_k_tokens`, as
`compute_candidates` calls it); and why vLLM's CPU build cannot serve a DFlash 2 draft (docs/serving.md)."""
from __future__ import annotations

import types

import pytest
import torch
from vllm.model_executor.models import qwen3_dflash2

from dflash_dist.models.dflash2 import grouped_conv
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec
from dflash_dist.models.qwen3 import rope_cos_sin
from dflash_dist.models.variants.dflash2.options import DFlash2Model

V, H = 96, 64


def spec(**options) -> DraftSpec:
    """The test's DFlash 2 drafter; `options`: its options (DFlash2Model fields) beside these."""
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=16, rope_theta=10000.0, rms_eps=1e-6, block_size=6, mask_token_id=V - 1,
                target_layer_ids=(0,), num_target_layers=3, variant="dflash2")
    mine = dict(conv_group_size=16, selector_top_k=7, selector_rank=12, output_multiplier=0.19,
                final_logit_softcapping=2.5)
    return DraftSpec(**base, options=DFlash2Model(**{**mine, **options}))


@pytest.mark.parametrize("block, taps, group", [(6, 2, 16), (8, 2, 8), (5, 3, 4)])
def test_conv_equals_vllms_grouped_conv(block, taps, group):
    gen = torch.Generator().manual_seed(block * taps)
    A, G = 4, H // group
    x = torch.randn(A, block, H, generator=gen)
    delta = torch.randn(A, block, taps, G, generator=gen)
    base = torch.randn(taps, H, generator=gen)
    # vLLM's rows: the blocks one after another, position = row % block_size.
    want = qwen3_dflash2._grouped_conv(x.flatten(0, 1), delta.flatten(0, 1), base, block, G, group, taps)
    torch.testing.assert_close(grouped_conv(x, delta, base, group).flatten(0, 1), want, rtol=1e-6, atol=1e-6)


def test_the_layer_wraps_attention_and_mlp_as_vllm_does():
    """vLLM's order: norm -> conv side 0 (deltas from the normed input) -> attention -> conv side 1 ->
    residual, and the same around the MLP; written out here with vLLM's `_grouped_conv`."""
    s = spec()
    torch.manual_seed(0)
    layer = DFlashDrafter(s).layers[0]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "conv" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    A, B, N = 3, s.block_size, 20
    x, ctx = torch.randn(A, B, H), torch.randn(N, H)
    lo, hi = torch.zeros(A, dtype=torch.long), torch.tensor([7, 12, 20])
    blk_rope = rope_cos_sin(hi[:, None] + torch.arange(B), s.head_dim, s.rope_theta, x.dtype)
    ctx_rope = rope_cos_sin(torch.arange(N), s.head_dim, s.rope_theta, x.dtype)
    got = layer(x, ctx, blk_rope, ctx_rope, lo, hi)

    def vllm_conv(conv, h, delta, side):
        return qwen3_dflash2._grouped_conv(h.flatten(0, 1), delta.flatten(0, 1), conv.base_kernel[side], B,
                                           conv.groups, conv.group_size, conv.taps).view_as(h)

    def wrapped(conv, sublayer, h):
        coef = conv.kernel_projection(h).reshape(A, B, 2, conv.taps, conv.groups)
        return vllm_conv(conv, sublayer(vllm_conv(conv, h, coef[:, :, 0], 0)), coef[:, :, 1], 1)

    h = x + wrapped(layer.attention_conv, lambda u: _attention(layer, u, ctx, ctx_rope, blk_rope, lo, hi),
                    layer.input_layernorm(x))
    want = h + wrapped(layer.mlp_conv, layer.mlp, layer.post_attention_layernorm(h))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _ctx_kv(layer, ctx, rope):
    from dflash_dist.models.qwen3 import apply_rope
    return apply_rope(layer.self_attn.k(ctx), *rope), layer.self_attn.v(ctx)


def _attention(layer, h, ctx, ctx_rope, blk_rope, lo, hi):
    """The DFlash attention sublayer alone (o_proj output) of normed block rows h."""
    from dflash_dist.models.attention import packed_block_attention
    from dflash_dist.models.qwen3 import apply_rope
    a = layer.self_attn
    k_ctx, v_ctx = _ctx_kv(layer, ctx, ctx_rope)
    out = packed_block_attention(apply_rope(a.q(h), *blk_rope), k_ctx, v_ctx, apply_rope(a.k(h), *blk_rope), a.v(h),
                                 lo, hi)
    return a.o_proj(out.flatten(-2))


def test_pair_scores_equal_vllms_score_edges():
    s = spec()
    torch.manual_seed(1)
    sel = DFlashDrafter(s).candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_()
    N, S, K = 5, s.block_size - 1, s.options.selector_top_k
    cand = torch.stack([torch.randperm(V)[:K] for _ in range(N * S)]).view(N, S, K)
    unary, hidden, anchors = torch.randn(N, S, K), torch.randn(N, S, H), torch.randint(0, V, (N,))
    want = qwen3_dflash2._score_edges(sel.predecessor_codebook, sel.successor_codebook, cand, unary,
                                      sel.hidden_projection(hidden), anchors, K)
    torch.testing.assert_close(sel.edge_scores(cand, unary, hidden, anchors), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("multiplier, cap", [(0.19, 2.5), (1.0, 0.0), (3.0, 30.0)])
def test_candidates_equal_vllms_top_k_processing(multiplier, cap):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    s = spec(output_multiplier=multiplier, final_logit_softcapping=cap)
    torch.manual_seed(2)
    drafter = DFlashDrafter(s)
    lm_head = torch.nn.Linear(H, V, bias=False)
    drafter.attach_target_head(torch.nn.Embedding(V, H), lm_head)
    hidden = torch.randn(40, H)
    with set_current_vllm_config(VllmConfig()):  # as DFlash2Qwen3ForCausalLM builds it
        processor = LogitsProcessor(V, scale=multiplier, soft_cap=cap if cap > 0 else None)
    # vLLM's unsharded head: what its quant method applies, one shard holding the whole vocabulary.
    head = types.SimpleNamespace(weight=lm_head.weight, tp_size=1,
                                 quant_method=types.SimpleNamespace(apply=lambda layer, x, bias=None: x @ layer.weight.T),
                                 shard_indices=types.SimpleNamespace(num_org_vocab_padding=0, org_vocab_start_index=0))
    want_ids, want_values = processor.get_top_k_tokens(head, hidden, s.options.selector_top_k)
    ids, values = drafter.unary_candidates(hidden, rows=7)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values, rtol=1e-6, atol=1e-6)
