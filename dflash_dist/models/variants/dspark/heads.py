"""DSpark's two heads on the backbone's final states, under the state-dict names vLLM 0.32's
`qwen3_dspark.py` loads (`markov_head.markov_w{1,2}.weight`, `confidence_head.proj.{weight,bias}`).

Markov head (the sequential stage): slot k's logits are lm_head(h_k) + W2 . W1[prev_k], with prev_k the
token before the one slot k drafts (the anchor at slot 0), W1 an embedding V x r and W2 a V x r
projection (vLLM's `markov_bias`: a head over the r-dim embedding). W2 starts at zero, so an untrained
DSpark drafter drafts what its DFlash backbone drafts; W1's rows start at unit expected norm.

Confidence head: sigmoid(w . [h_k; W1[prev_k]] + b) (the Markov part with `confidence_head_with_markov`),
in float32 as vLLM keeps it (`params_dtype=torch.float32`), an estimate of slot k's acceptance.
"""
from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight (V, r), vLLM's ParallelLMHead's
        nn.init.normal_(self.markov_w1.weight, std=rank ** -0.5)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        """(..., V) the transition bias of Markov embeddings (..., r)."""
        return embed @ self.markov_w2.weight.T


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)

    def logit(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """(...,) the pre-sigmoid confidence of final states (..., H) after Markov embeddings (..., r)."""
        x = torch.cat([hidden, embed], dim=-1) if self.with_markov else hidden
        return self.proj(x.float()).squeeze(-1)


@torch.no_grad()
def markov_walk(model, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
    """(N, B) the greedy tokens of blocks' final states (N, B, H): left to right, each slot's logits
    lm_head(h_k) + the Markov bias of the token drafted before it (the anchor's at slot 0), as vLLM's
    `DSparkSpeculator._sample_sequential` drafts at temperature 0."""
    head, markov = model.lm_head, model.markov_head
    base = head(hidden.to(head.weight.dtype)).float()
    prev, out = anchor_ids, []
    for k in range(hidden.shape[1]):
        prev = (base[:, k] + markov.bias(markov.embed(prev)).float()).argmax(-1)
        out.append(prev)
    return torch.stack(out, dim=1)
