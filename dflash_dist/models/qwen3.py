"""Qwen3 building blocks and the built-in tiny Qwen3-style target.

Parameter names follow transformers' Qwen3 decoder layer (`self_attn.q_proj`, `mlp.gate_proj`, ...),
so the drafter exports to the z-lab format without renaming and a real Qwen3 maps onto the same code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_dist.models.attention import packed_causal_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape positions.shape + (head_dim,), in the half-rotation layout of Llama/Qwen."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., tokens, heads, head_dim); cos/sin: (..., tokens, head_dim)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections and q/k norms of a Qwen3 attention block; the forward lives with its user."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def q(self, x):
        return self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))

    def k(self, x):
        return self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))

    def v(self, x):
        return self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, hidden, inter, num_heads, num_kv_heads, head_dim, eps):
        super().__init__()
        self.self_attn = Attention(hidden, num_heads, num_kv_heads, head_dim, eps)
        self.mlp = MLP(hidden, inter)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int | None = None):
        """x: (N, H) packed tokens; causal attention inside each sequence of cu_seqlens (the longest is
        max_seqlen, when the caller knows it: the flash path then needs no host synchronisation)."""
        a = self.self_attn
        h = self.input_layernorm(x)
        q, k, v = apply_rope(a.q(h), cos, sin), apply_rope(a.k(h), cos, sin), a.v(h)
        x = x + a.o_proj(packed_causal_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen).flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyQwen3(nn.Module):
    """A Qwen3-style causal LM over packed batches. `capture` is the target's whole job (a `Target`)."""
    kind = "tiny"

    def __init__(self, tc):
        super().__init__()
        self.vocab_size, self.hidden_size, self.num_layers = tc.vocab_size, tc.hidden_size, tc.num_layers
        self.head_dim, self.rope_theta, self.rms_eps = tc.head_dim, tc.rope_theta, tc.rms_eps
        self.max_position_embeddings = 40960  # RoPE is computed per position: any length; a Qwen3's value
        self.num_heads, self.num_kv_heads, self.intermediate_size = tc.num_heads, tc.num_kv_heads, tc.intermediate_size
        self.embed_tokens = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(tc.hidden_size, tc.intermediate_size, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.rms_eps)
            for _ in range(tc.num_layers))
        self.norm = RMSNorm(tc.hidden_size, tc.rms_eps)
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tc.seed)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=m.weight.shape[1] ** -0.5 if isinstance(m, nn.Linear) else 1.0)

    @torch.no_grad()
    def capture(self, input_ids, cu_seqlens, position_ids, layer_ids, need_logits: bool = False,
                final_hidden: bool = False):
        """Hidden states after each layer in `layer_ids` (z-lab convention: layer i's output is
        hidden_states[i + 1]), concatenated on the feature axis: (N, len(layer_ids) * H), and the logits
        (N, V) if asked for, or with `final_hidden` the final normed hidden state (N, H) they come from.
        The forward stops after the last captured layer unless either is asked for."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta, x.dtype)
        wanted = set(layer_ids)
        captured = {}
        last = self.num_layers if need_logits or final_hidden else max(layer_ids) + 1
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # one host sync per forward, not per layer
        for i in range(last):
            x = self.layers[i](x, cos, sin, cu_seqlens, longest)
            if i in wanted:
                captured[i] = x
        feats = torch.cat([captured[i] for i in layer_ids], dim=-1)
        if not (need_logits or final_hidden):
            return feats, None
        return feats, self.lm_head(self.norm(x)) if need_logits else self.norm(x)
