"""The two modules DFlash 2 adds to the DFlash drafter: the grouped dynamic convolution and the candidate
path selector (the serving contract: vLLM 0.32's `qwen3_dflash2.py` and its `dflash2` speculator).

Grouped convolution (`GroupedConv`), one around each attention and each MLP sublayer: a projection of
the sublayer's (normed) input gives, per row, per side (0 before the sublayer, 1 after it), per tap and per
channel group, a delta added to the learned `base_kernel`; output row i, channel c is
sum_t (base[side, t, c] + delta[i, side, t, group(c)]) * x[i - t, c], taps reading rows of the same block
only (zero at block positions < t). Initialised as the identity (tap 0 = 1, the rest and the projection
zero), so an untrained DFlash 2 drafter computes what its DFlash backbone computes.

Candidate selector (`CandidateSelector`): per drafted position t the unary head's top-K tokens, their
logits scaled by `output_multiplier` then soft-capped (U_t); a pair score
S_t(a, b) = U_t(b) + <A[a] * P h_t, B[b]> with rank-R predecessor/successor codebooks A, B (V x R) and a
hidden projection P (H -> R), a being the previous position's candidate (the anchor token at t = 1).
Decoding walks the block greedily over S (`walk`). Nothing here builds a rows x vocabulary tensor
beyond one row chunk of logits (`unary_top_k`), and the codebooks are read by row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (A, B, H) blocks (dim 1: the block positions); delta (A, B, taps, G) per-row deltas; base (taps, H).
    Tap t reads position p - t of the same block, zero where p < t (the blocks' own dim holds that)."""
    taps, H = base.shape
    G = H // group_size
    blocks = x.unflatten(-1, (G, group_size))  # (A, B, G, gs)
    base = base.view(taps, G, group_size)
    out = None
    for t in range(taps):
        # Each tap's kernel on its own: backward then sums into delta's (A, B, G) entries of tap t, never
        # through an (A, B, taps, G, gs) gradient filled with zeros.
        coef = base[t] + delta[:, :, t].unsqueeze(-1)  # (A, B, G, gs)
        term = coef * (blocks if t == 0 else F.pad(blocks[:, :-t], (0, 0, 0, 0, t, 0)))
        out = term if out is None else out + term
    return out.flatten(-2)


class GroupedConv(nn.Module):
    """`base_kernel` (2, taps, H) and `kernel_projection` (H -> 2 * taps * G): the names of the contract."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        if taps < 1 or group_size < 1 or hidden % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide the hidden size {hidden} "
                             f"(and conv_kernel_size {taps} be >= 1)")
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0  # identity: tap 0 passes the row through
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(side 0 applied to h, side 1's deltas for `finish`); h (A, B, H)."""
        coef = self.kernel_projection(h).unflatten(-1, (2, self.taps, self.groups))
        return grouped_conv(h, coef[..., 0, :, :], self.base_kernel[0].to(h.dtype), self.group_size), coef[..., 1, :, :]

    def finish(self, out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_conv(out, delta.to(out.dtype), self.base_kernel[1].to(out.dtype), self.group_size)


def unary_values(logits: torch.Tensor, multiplier: float, softcap: float) -> torch.Tensor:
    """The served unary scores of raw head logits: scaled, then soft-capped (vLLM's top-K processing)."""
    z = logits.float() * multiplier if multiplier != 1.0 else logits.float()
    return torch.tanh(z / softcap) * softcap if softcap > 0 else z


@torch.no_grad()
def unary_top_k(hidden: torch.Tensor, head_weight: torch.Tensor, k: int, rows: int = 8192) -> torch.Tensor:
    """Top-k token ids (n, k) of the head's logits for rows (n, H), `rows` rows of logits at a time. The
    multiplier and the soft cap are monotonic (the multiplier is positive), so they do not change the set."""
    w = head_weight.to(hidden.dtype)
    return torch.cat([(hidden[i:i + rows] @ w.T).topk(k, dim=-1).indices for i in range(0, hidden.shape[0], rows)])


def _rows_at(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] (ids.shape + (D,)) by index_select: the same values as advanced indexing, gathered
    faster on CPU."""
    return table.index_select(0, ids.reshape(-1)).view(*ids.shape, table.shape[-1])


class _CandidateLogits(torch.autograd.Function):
    """z[r, j] = h[r] . W[ids[r, j]] for a frozen head W, `rows` rows at a time, or the given `values` of
    them (the same logits, already computed by the loss's pass of the head). The backward,
    dh[r] = sum_j dz[r, j] W[ids[r, j]], is one weighted embedding bag per row: no (n, k, H) gather is
    saved or made (on CPU ~10x faster than gathering and contracting)."""

    @staticmethod
    def forward(ctx, h, weight, ids, rows: int, values):
        if values is not None:
            out = values.float()
        elif h.shape[0]:
            w = weight.to(h.dtype)
            out = torch.cat([torch.einsum("rh,rkh->rk", h[i:i + rows], _rows_at(w, ids[i:i + rows])).float()
                             for i in range(0, h.shape[0], rows)])
        else:
            out = h.new_zeros(0, ids.shape[1]).float()
        ctx.save_for_backward(h, weight, ids)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, weight, ids = ctx.saved_tensors
        if not h.shape[0]:
            return torch.zeros_like(h), None, None, None, None
        gh = F.embedding_bag(ids, weight.to(h.dtype), per_sample_weights=grad.to(h.dtype), mode="sum")
        return gh, None, None, None, None


def candidate_logits(h: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor, rows: int = 8192,
                     values: torch.Tensor | None = None) -> torch.Tensor:
    """The frozen head's logits (n, k) float32 at token ids (n, k) for rows h (n, H), differentiable in h;
    `values`: those logits where already known (`lm_head_loss`'s top-k), so only the backward runs."""
    return _CandidateLogits.apply(h, head_weight, ids, rows, values)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= vocab:
            raise ValueError(f"selector_top_k {top_k} must be in [1, vocab size {vocab}]")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        # Zero: the pair term starts at 0, so an untrained selector walks the unary head's argmax path.
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """P h (..., R) float32 of rows hidden (..., H)."""
        return self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()

    def pair_scores(self, prev_ids: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor,
                    hidden: torch.Tensor) -> torch.Tensor:
        """S(a, b) for predecessors prev_ids (..., P) and candidates cand_ids (..., C) with their unary
        scores (..., C), at rows hidden (..., H): (..., P, C) float32."""
        proj = self.project(hidden)  # (..., R)
        pred = _rows_at(self.predecessor_codebook, prev_ids).float() * proj.unsqueeze(-2)  # (..., P, R)
        succ = _rows_at(self.successor_codebook, cand_ids).float()  # (..., C, R)
        return unary.float().unsqueeze(-2) + pred @ succ.transpose(-1, -2)

    def edge_scores(self, cand_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                    anchor_ids: torch.Tensor) -> torch.Tensor:
        """Every position's K x K scores (N, S, K, K) for candidates (N, S, K) of the S drafted positions of
        N blocks: position 0's predecessors are the anchor token (all K rows the same), later positions'
        the candidates of the position before."""
        K = cand_ids.shape[-1]
        prev = torch.cat([anchor_ids[:, None, None].expand(-1, 1, K), cand_ids[:, :-1]], dim=1)
        return self.pair_scores(prev, cand_ids, unary, hidden)

    def scores_after(self, prev_ids: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor,
                     proj: torch.Tensor) -> torch.Tensor:
        """`pair_scores` for one predecessor per row: S(prev, .) (n, C) float32 for prev_ids (n,),
        candidates (n, C), their unary scores (n, C) and the rows' projections `project(h)` (n, R). The
        successor rows on the left of the product: its backward then yields their gradient in their own
        (n, C, R) layout, no transposed copy."""
        pred = _rows_at(self.predecessor_codebook, prev_ids).float() * proj  # (n, R)
        succ = _rows_at(self.successor_codebook, cand_ids).float()  # (n, C, R)
        return unary.float() + (succ @ pred.unsqueeze(-1)).squeeze(-1)

    def greedy_path(self, cand_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                    anchor_ids: torch.Tensor) -> torch.Tensor:
        """`walk(self.edge_scores(...), cand_ids)` scoring only the row the walk reads at each position
        (its chosen predecessor's): K x R per position instead of K x K x R, and no (N, S, K, R) gather
        of the predecessor codebook. The same scores to float32 rounding."""
        N, S, _ = cand_ids.shape
        proj = self.project(hidden)  # (N, S, R)
        rows = torch.arange(N, device=cand_ids.device)
        prev, picks = anchor_ids, []
        for t in range(S):
            scores = self.scores_after(prev, cand_ids[:, t], unary[:, t], proj[:, t])
            prev = cand_ids[rows, t, scores.argmax(-1)]
            picks.append(prev)
        return torch.stack(picks, dim=1) if picks else cand_ids[:, :, 0]


def walk(scores: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
    """The greedy (temperature 0) path (N, S) over edge scores (N, S, K, K): position 0 takes the best of
    row 0, each later position the best of the row of the candidate chosen before it (first index on a
    tie, as argmax)."""
    N, S, K, _ = scores.shape
    prev = torch.zeros(N, dtype=torch.long, device=scores.device)
    rows = torch.arange(N, device=scores.device)
    picks = []
    for t in range(S):
        prev = scores[rows, t, prev].argmax(-1)
        picks.append(cand_ids[rows, t, prev])
    return torch.stack(picks, dim=1) if picks else cand_ids[:, :, 0]
