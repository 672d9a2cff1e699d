"""The DFlash draft model: a few Qwen3 decoder layers conditioned on fused target features.

Features of `target_layer_ids` (concatenated) -> `fc` (n*H -> H, no bias) -> `hidden_norm`: the
context. In every draft layer, keys and values are the k/v projections of [context | block]; k_norm
and RoPE run over that whole key sequence (context at its own positions, block slot k at anchor + k);
queries come from the block only. The embedding and LM head are the target's, frozen, and kept outside
this module's parameters so that the drafter's state dict is exactly what the z-lab format holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_dist.models.attention import packed_block_attention, prepare_block_attention
from dflash_dist.models.qwen3 import DecoderLayer, RMSNorm, apply_rope, rope_cos_sin
from dflash_dist.models.variants import Variant, variant_of


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
    # The target's context length, exported as the drafter's: the engines feed the drafter positions up
    # to the target's, and SGLang refuses a draft with a shorter context (docs/serving.md).
    max_position_embeddings: int = 40960
    # A name of models/variants' registry: `dflash`, `dflash2` (the grouped convolution and the selector),
    # `dspark` (anchor-as-first blocks, the Markov bias and the confidence head), `domino` (anchor-as-first
    # blocks, the GRU logit delta), or one registered from outside.
    variant: str = "dflash"
    # The variant's options that fix the drafter: its `Model` value (models/variants/<name>/options.py), read
    # by its modules and written by its export; None: its defaults.
    options: Any = None

    def __post_init__(self) -> None:
        family = self.family
        if self.options is None:
            object.__setattr__(self, "options", family.Model())
        elif type(self.options) is not family.Model:
            # its Options (with the loss knobs), or another variant's value (`replace(spec, variant=...)`)
            object.__setattr__(self, "options", family.model_options(self.options))

    @property
    def family(self) -> Variant:
        """The variant object: its modules, loss term, export contract and decode step."""
        return variant_of(self.variant)

    @property
    def step_tokens(self) -> int:
        """The most tokens one verify step commits: the block's drafts and the bonus token (B; DSpark's
        anchor-as-first blocks B + 1). What the evaluation's tallies count positions up to."""
        return self.family.drafts(self.block_size) + 1


def wrapped(wrapper: nn.Module | None, sublayer, h: torch.Tensor) -> torch.Tensor:
    """sublayer(h) as it is (DFlash), or inside a variant's sublayer wrapper (`Variant.sublayer_wrappers`,
    DFlash 2's grouped convolution): `wrapper.prepare(h)` gives the sublayer's input and a state that
    `wrapper.finish(out, state)` combines with its output."""
    if wrapper is None:
        return sublayer(h)
    h, state = wrapper.prepare(h)
    return wrapper.finish(sublayer(h), state)


class DraftLayer(DecoderLayer):
    """A Qwen3 decoder layer whose keys and values also cover the fused target context; a variant may wrap
    its attention and its MLP (DFlash 2: a grouped convolution over the block each, vLLM's
    `DFlash2Qwen3DecoderLayer.forward`: the context's keys and values do not pass through it)."""

    def __init__(self, s: DraftSpec):
        super().__init__(s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_eps)
        self.attention_conv, self.mlp_conv = s.family.sublayer_wrappers(s)

    def forward(self, x, ctx, blk_rope, ctx_rope, ctx_start, ctx_end, prepared=None):
        """x: (A, B, H) blocks; ctx: (N, H) fused context of the packed batch. Block j attends to context
        rows [ctx_start[j], ctx_end[j]) (its sequence, strictly before its anchor) and its own block.
        `prepared`: the attention's mask or runs for these bounds, built once and shared by the layers."""
        a = self.self_attn
        k_ctx, v_ctx = apply_rope(a.k(ctx), *ctx_rope), a.v(ctx)
        return self.over_context(x, k_ctx, v_ctx, blk_rope, ctx_start, ctx_end, prepared)

    def over_context(self, x, k_ctx, v_ctx, blk_rope, ctx_start, ctx_end, prepared=None):
        """The layer given the context's keys (k_norm, RoPE applied) and values (a decoder's cache)."""
        a = self.self_attn

        def attend(h):
            q = apply_rope(a.q(h), *blk_rope)
            k_blk, v_blk = apply_rope(a.k(h), *blk_rope), a.v(h)
            out = packed_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_start, ctx_end, prepared=prepared)
            return a.o_proj(out.flatten(-2))
        x = x + wrapped(self.attention_conv, attend, self.input_layernorm(x))
        return x + wrapped(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DraftSpec, checkpoint_layers: bool = False):
        super().__init__()
        self.spec = spec
        self.checkpoint_layers = checkpoint_layers  # recompute each layer in backward: activations per layer
        n_feat = len(spec.target_layer_ids)
        self.fc = nn.Linear(n_feat * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.variant = spec.family
        for name, head in self.variant.heads(spec).items():
            self.add_module(name, head)
        # Frozen, shared with the target; set by `attach_target_head`. Not parameters of this module.
        self._embed: nn.Embedding | None = None
        self._lm_head: nn.Linear | None = None

    def attach_target_head(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        for p in list(embed_tokens.parameters()) + list(lm_head.parameters()):
            p.requires_grad_(False)
        # object.__setattr__ keeps them out of parameters(), state_dict() and gradient syncs.
        object.__setattr__(self, "_embed", embed_tokens)
        object.__setattr__(self, "_lm_head", lm_head)

    @property
    def lm_head(self) -> nn.Linear:
        return self._lm_head

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """(N, n_layers*H) target features -> (N, H) fused context. Under autocast the features go to
        `fc` as they are (bf16): a float32 copy of a 49K-token batch would be 3.8 GiB for nothing. Columns past the
        captured layers' (DSpark's target final state, `Variant.needs.final_hidden`) are not the context's."""
        if features.shape[-1] != self.fc.in_features:
            features = features[..., :self.fc.in_features]
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(features))

    def forward(self, ctx, input_ids, position_ids, anchors, ctx_start, *, offset: int = 0) -> torch.Tensor:
        """Final-normed hidden states (A, B, H) of the blocks at `anchors` (packed indices): one anchor
        chunk of the training step (`training.step.drafter_step` calls the module, so that DDP's reducer
        and FSDP's gathers wrap it), and the decoders' draft pass (`draft_hidden`).

        ctx: rows [offset, offset + len(ctx)) of the fused context (`context`), which must hold every row
        these blocks see; ctx_start: (A,) first packed index of each anchor's sequence. Block j is
        [token at anchor j, MASK x (B-1)] at positions anchor_j + k and sees context rows
        [ctx_start[j], anchors[j]). Anchors may be any subset of a batch's (a chunk). `offset` is keyword
        only: a call with the one-pass signature of `block_logits` (six positional) fails, not misreads."""
        s = self.spec
        B, dev, n = s.block_size, anchors.device, ctx.shape[0]
        block_ids = torch.full((anchors.numel(), B), s.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = input_ids[anchors]
        x = self._embed(block_ids).to(ctx.dtype)
        blk_pos = position_ids[anchors][:, None] + torch.arange(B, device=dev)
        blk_rope = rope_cos_sin(blk_pos, s.head_dim, s.rope_theta, x.dtype)
        ctx_rope = rope_cos_sin(position_ids[offset:offset + n], s.head_dim, s.rope_theta, x.dtype)
        lo, hi = ctx_start - offset, anchors - offset  # in rows of `ctx`
        prepared = prepare_block_attention(lo, hi, n, anchors.numel(), B, like=x)
        for layer in self.layers:
            if self.checkpoint_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, ctx, blk_rope, ctx_rope, lo, hi, prepared, use_reentrant=False)
            else:
                x = layer(x, ctx, blk_rope, ctx_rope, lo, hi, prepared)
        return self.norm(x)

    def draft_hidden(self, ctx, input_ids, position_ids, anchors, ctx_start, *, offset: int = 0) -> torch.Tensor:
        """`forward` by the name the decoders, benchmarks and tests call it on a bare drafter (no
        training wrapper around it)."""
        return self.forward(ctx, input_ids, position_ids, anchors, ctx_start, offset=offset)

    def block_logits(self, features, input_ids, cu_seqlens, position_ids, anchors, anchor_cu) -> torch.Tensor:
        """Logits (A, B, V) of every block of a packed batch, in one pass (evaluation and the tests'
        plain references; training goes through `dflash_dist.training.step`).

        features: (N, n_layers*H) target features of the packed batch; input_ids, position_ids: (N,);
        cu_seqlens: (S+1,); anchors: (A,) packed indices, sorted, grouped by sequence;
        anchor_cu: (S+1,) anchors of sequence s are anchors[anchor_cu[s]:anchor_cu[s+1]].
        """
        hidden = self.forward(self.context(features), input_ids, position_ids, anchors,
                              anchor_seq_starts(cu_seqlens, anchor_cu, anchors.numel()))
        return self._lm_head(hidden.to(self._lm_head.weight.dtype))

    def unary_candidates(self, hidden: torch.Tensor, rows: int = 8192):
        """(ids (n, K), served unary scores (n, K) float32) of final-normed rows (n, H), for a variant whose
        drafts choose among the head's top-K (DFlash 2's `unary_candidates`; an AttributeError for one
        that has none). The backbone imports no variant: it asks its own."""
        return self.variant.unary_candidates(self, hidden, rows)

    @torch.no_grad()
    def block_tokens(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The drafted tokens (N, B-1) of blocks' final-normed states (N, B, H) at temperature 0: the
        variant's decode step (the unary argmax; DFlash 2's selector walk over the top-K candidates)."""
        return self.variant.block_tokens(self, hidden, anchor_ids)

def anchor_seq_starts(cu_seqlens: torch.Tensor, anchor_cu: torch.Tensor, num_anchors: int) -> torch.Tensor:
    """(A,) first packed index of each anchor's sequence."""
    counts = (anchor_cu[1:] - anchor_cu[:-1]).to(cu_seqlens.device)
    return torch.repeat_interleave(cu_seqlens[:-1], counts, output_size=num_anchors)
