"""What the project needs of a frozen target, declared once (`Target`): its shapes, its frozen embedding
and LM head (the drafter borrows both), `capture` (features of a few layers, optionally logits) and
`kind`, which says how it decodes: `tiny` (the built-in TinyQwen3: a batched KV cache of its own,
`models/decode.py`), `hf` (a transformers model: its own KV cache and `greedy`, a tokenizer beside it),
`recompute` (any other module with `capture`: decoded by recomputing the whole sequence at each token,
slow and exact), `head` (a drafter rank's embedding and head only: it never decodes). Code that needs more than the shapes
dispatches on `kind`, never on which attributes an object happens to have."""
from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn

TargetKind = Literal["tiny", "hf", "recompute", "head"]


@runtime_checkable
class TargetShapes(Protocol):
    """Every target, the head-only one included: what a drafter is built from."""
    kind: TargetKind
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    max_position_embeddings: int
    embed_tokens: nn.Embedding
    lm_head: nn.Linear


@runtime_checkable
class Target(TargetShapes, Protocol):
    """A target that runs: target ranks capture with it, evaluation decodes with it."""

    def capture(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor,
                layer_ids, need_logits: bool = False, final_hidden: bool = False):
        """(features (N, len(layer_ids) * H), logits (N, V) or the final normed hidden (N, H) or None)."""
        ...
