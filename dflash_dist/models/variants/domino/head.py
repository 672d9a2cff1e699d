"""Domino's logit head on the backbone's final states, under the state-dict names SGLang's DFlash model
loads for `dflash_config.projector_type: "domino"` (sglang/srt/models/dflash.py: `prefix_gru.weight_ih_l0`
[3G, H], `prefix_gru.weight_hh_l0` [3G, G], `embed_proj.0.weight` [E, H + G], `embed_proj.2.weight` [V, E]).

Slot k >= 1's logits are lm_head(h_k) + W2 . SiLU(W1 . [h_k; s_k]); slot 0's are lm_head(h_0) alone
(`pure_draft_prefix_len: 1`). s_k is the state of a bias-free one-layer GRU over the target's (frozen)
embeddings of the tokens before the one slot k drafts: it has consumed the anchor and the k tokens after
it, so with "anchor as first" blocks (`shift_label: true`: slot k drafts anchor + k + 1) that is every
token before slot k's draft. In training they are the data's tokens (teacher forcing), in decoding the
drafted ones. Sources for this convention: SpecForge's specforge/modeling/draft/domino.py
(`apply_logits_head` with shift_label: the GRU runs over the block's previous-token embeddings and slot k
reads its output at position k, k >= suffix_start = pure_draft_prefix_len = 1; the previous tokens are the
data's at anchor + k, specforge/algorithms/common/dflash_family_model.py `_build_domino_head_inputs`) and
SGLang's sglang/srt/speculative/domino_utils.py (`domino_greedy_rollout`: slot 0 the base argmax, then the
GRU over [bonus token, first draft] feeds slot 1, each later draft is fed to the GRU before the next slot).

The GRU is computed here from its two weights by torch's GRU equations (docs of `torch.nn.GRU`, no biases:
r, z = sigmoid(W_i{r,z} x + W_h{r,z} h), n = tanh(W_in x + r * (W_hn h)), h' = (1 - z) * n + z * h),
rather than by calling the nn.GRU module: the weights are read at each call (FSDP2's gathered parameters
included, which nn.GRU's cached flat weights would miss), training and decoding run one code path, and a
unit test holds it equal to nn.GRU's own forward (what SGLang runs). The head runs in float32 outside the
draft layers' autocast, as DSpark's heads do.

W2 starts at zero, so an untrained Domino drafter drafts what its DFlash backbone drafts (SpecForge keeps
the module's default initialisation; the decay of lambda from 1 makes the head's first steps moot anyway).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def domino_heads(hidden_size: int, gru_hidden: int, emb_dim: int, vocab_size: int) -> dict[str, nn.Module]:
    gru = nn.GRU(hidden_size, gru_hidden, num_layers=1, bias=False, batch_first=True)
    proj = nn.Sequential(nn.Linear(hidden_size + gru_hidden, emb_dim, bias=False), nn.SiLU(),
                         nn.Linear(emb_dim, vocab_size, bias=False))
    nn.init.zeros_(proj[2].weight)
    return {"prefix_gru": gru, "embed_proj": proj}


def gru_input(model, ids: torch.Tensor) -> torch.Tensor:
    """(..., 3G) W_ih . embed(ids): the input's part of every gate, float32."""
    w = model.prefix_gru.weight_ih_l0
    return model._embed(ids).to(w.dtype) @ w.T


def gru_step(model, gi: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The next state (N, G) of states (N, G) after inputs whose gate parts are gi (N, 3G)."""
    gh = state @ model.prefix_gru.weight_hh_l0.T
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * state


def prefix_states(model, prev: torch.Tensor) -> torch.Tensor:
    """(A, B, G) the GRU's state at each slot of blocks whose previous tokens are prev (A, B): slot k's
    has consumed prev[:, :k + 1]."""
    gi = gru_input(model, prev)
    state = gi.new_zeros(prev.shape[0], model.prefix_gru.hidden_size)
    out = []
    for k in range(prev.shape[1]):
        state = gru_step(model, gi[:, k], state)
        out.append(state)
    return torch.stack(out, dim=1)


def delta_features(model, hidden: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """(..., E) SiLU(W1 . [h; s]) of final states (..., H) and GRU states (..., G), float32: the logit
    delta is this times W2 (`embed_proj.2`), left to the caller (the loss's row chunks, the walk)."""
    proj = model.embed_proj
    w1 = proj[0].weight
    return F.silu(torch.cat([hidden.to(w1.dtype), states], dim=-1) @ w1.T)


@torch.no_grad()
def domino_rollout(model, hidden: torch.Tensor, anchor_ids: torch.Tensor, forced: torch.Tensor | None = None,
                   keep_logits: bool = False):
    """(tokens (N, B), logits (N, B, V) float32 or None) of blocks' final states (N, B, H), left to right
    at temperature 0: slot 0 the base argmax, slot k >= 1 base + delta with the GRU fed the anchor and the
    tokens drafted before slot k (SGLang's `domino_greedy_rollout` over the whole vocabulary). `forced`
    (N, B - 1): feed these tokens to the GRU instead of the drafts (teacher forcing, for the tests)."""
    head, w2 = model.lm_head, model.embed_proj[2].weight
    base = head(hidden.to(head.weight.dtype)).float()
    state = gru_step(model, gru_input(model, anchor_ids), base.new_zeros(len(anchor_ids), model.prefix_gru.hidden_size))
    prev = base[:, 0].argmax(-1)
    tokens, logits = [prev], [base[:, 0]]
    for k in range(1, hidden.shape[1]):
        state = gru_step(model, gru_input(model, prev if forced is None else forced[:, k - 1]), state)
        z = base[:, k] + delta_features(model, hidden[:, k], state) @ w2.T
        prev = z.argmax(-1)
        tokens.append(prev)
        if keep_logits:
            logits.append(z)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1) if keep_logits else None
