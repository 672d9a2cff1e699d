"""The DFlash draft model: a few Qwen3 decoder layers conditioned on fused target features.

Features of `target_layer_ids` (concatenated) -> `fc` (n*H -> H, no bias) -> `hidden_norm`: the
context. In every draft layer, keys and values are the k/v projections of [context | block]; k_norm
and RoPE run over that whole key sequence (context at its own positions, block slot k at anchor + k);
queries come from the block only. The embedding and LM head are the target's, frozen, and kept outside
this module's parameters so that the drafter's state dict is exactly what the z-lab format holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_dist.models.attention import packed_block_attention
from dflash_dist.models.qwen3 import MLP, Attention, RMSNorm, apply_rope, rope_cos_sin


@dataclass(frozen=True)
class DraftSpec:
    """Everything that fixes the drafter's shapes (exported as its config)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int


class DraftLayer(nn.Module):
    def __init__(self, s: DraftSpec):
        super().__init__()
        self.self_attn = Attention(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_eps)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_eps)

    def forward(self, x, ctx, blk_rope, ctx_rope, ctx_start, ctx_end):
        """x: (A, B, H) blocks; ctx: (N, H) fused context of the packed batch. Block j attends to context
        rows [ctx_start[j], ctx_end[j]) (its sequence, strictly before its anchor) and its own block."""
        a = self.self_attn
        h = self.input_layernorm(x)
        q = apply_rope(a.q(h), *blk_rope)
        k_blk, v_blk = apply_rope(a.k(h), *blk_rope), a.v(h)
        k_ctx, v_ctx = apply_rope(a.k(ctx), *ctx_rope), a.v(ctx)
        out = packed_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end)
        x = x + a.o_proj(out.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        n_feat = len(spec.target_layer_ids)
        self.fc = nn.Linear(n_feat * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_eps)
        # Frozen, shared with the target; set by `attach_target_head`. Not parameters of this module.
        self._embed: nn.Embedding | None = None
        self._lm_head: nn.Linear | None = None

    def attach_target_head(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        for p in list(embed_tokens.parameters()) + list(lm_head.parameters()):
            p.requires_grad_(False)
        # object.__setattr__ keeps them out of parameters(), state_dict() and DDP's buckets.
        object.__setattr__(self, "_embed", embed_tokens)
        object.__setattr__(self, "_lm_head", lm_head)

    def forward(self, features, input_ids, cu_seqlens, position_ids, anchors, anchor_cu):
        """Logits (A, B, V) of every block.

        features: (N, n_layers*H) target features of the packed batch; input_ids, position_ids: (N,);
        cu_seqlens: (S+1,); anchors: (A,) packed indices, sorted, grouped by sequence;
        anchor_cu: (S+1,) anchors of sequence s are anchors[anchor_cu[s]:anchor_cu[s+1]].
        """
        s = self.spec
        B = s.block_size
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        block_ids = torch.full((anchors.numel(), B), s.mask_token_id, dtype=torch.long, device=anchors.device)
        block_ids[:, 0] = input_ids[anchors]
        x = self._embed(block_ids).to(ctx.dtype)
        anchor_pos = position_ids[anchors]
        blk_pos = anchor_pos[:, None] + torch.arange(B, device=anchors.device)
        blk_rope = rope_cos_sin(blk_pos, s.head_dim, s.rope_theta, x.dtype)
        ctx_rope = rope_cos_sin(position_ids, s.head_dim, s.rope_theta, x.dtype)
        seq = torch.repeat_interleave(torch.arange(anchor_cu.numel() - 1, device=anchors.device),
                                      anchor_cu[1:] - anchor_cu[:-1], output_size=anchors.numel())
        ctx_start, ctx_end = cu_seqlens.to(anchors.device)[seq], anchors  # [sequence start, anchor)
        for layer in self.layers:
            x = layer(x, ctx, blk_rope, ctx_rope, ctx_start, ctx_end)
        return self._lm_head(self.norm(x).to(self._lm_head.weight.dtype))
