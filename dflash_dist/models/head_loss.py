"""The chunked LM-head loss, written once: the row loop, the gradient buffers and the backward.

A loss over the frozen LM head (V x H) runs `rows` labelled rows at a time, so that never more than
rows x V logits live at once, forward or backward. Each chunk's input gradients are computed in the
forward from that chunk's logits and are all that is kept (rows x H and the like, next to nothing beside
the activations): recomputing the logits in the backward would cost a third (rows x H x V) matmul per
chunk where this costs two, and the head is about a quarter of a drafter step's FLOPs. The price is a
gradient computed that nobody may ask for, so it is skipped where autograd will not need it.

What a loss computes on one chunk is one function, a term: `term(Chunk) -> ChunkLoss` (the plain head's
label modes in training/objective.py, a variant's own in models/variants/*_loss.py). `chunk_rows` runs it
over the rows and gathers what it returns: the per-row values into buffers of every row, each row
input's gradient into a buffer of every row, each shared input's (a weight matrix's) gradient summed
over the chunks. `with_gradients` turns the summed loss into one differentiable in the inputs, whose
backward scales those buffers by the incoming gradient. Nothing is handed back through an argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


class Chunk(NamedTuple):
    """What a term sees of one row chunk."""
    rows: slice  # the chunk's rows [i, j) of the n: the term slices its own per-row tensors (labels, weights) by it
    inputs: tuple[torch.Tensor, ...]  # each row input's rows of the chunk (r, d)
    need_grad: bool  # whether autograd will ask for the gradient: the term then returns `grads` and `shared`


class ChunkLoss(NamedTuple):
    """What a term returns for its chunk of r rows."""
    loss: torch.Tensor  # () float32: the chunk's summed loss
    values: tuple  # a tuple (a NamedTuple's fields alike) of per-row results (r, ...) or None: argmax, ...
    grads: tuple[torch.Tensor, ...] = ()  # with need_grad: d loss / d each row input's chunk, (r, d)
    shared: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # with need_grad, per shared input: (x, y),
    # its gradient's share x @ y, which is accumulated in place (addmm) rather than materialised


class Rows(NamedTuple):
    """`chunk_rows`' result over all n rows: the loss summed in chunk order, every value of the term's
    `values` concatenated (the same tuple type, None where the term gave none), each row input's gradient
    (n, d) and each shared input's; both () where no gradient is needed."""
    loss: torch.Tensor
    values: tuple
    grads: tuple[torch.Tensor, ...]
    shared: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class RowInputs:
    """The differentiable inputs of a chunked loss. Row r of each row input is its row r, or with `index`
    its flattened (..., d) row index[r] (the plain head reads its labelled rows of (A, B, H) in place:
    no (n, H) copy). `shared`: inputs every row reads (a variant's weight matrix)."""
    rows: tuple[torch.Tensor, ...]
    shared: tuple[torch.Tensor, ...] = ()
    index: torch.Tensor | None = None

    def count(self) -> int:
        return self.index.numel() if self.index is not None else self.rows[0].shape[0]

    def flat(self) -> tuple[torch.Tensor, ...]:
        return self.rows if self.index is None else tuple(x.reshape(-1, x.shape[-1]) for x in self.rows)

    def need_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (*self.rows, *self.shared))


def chunk_rows(term: Callable[[Chunk], ChunkLoss], inputs: RowInputs, rows: int,
               grad_dtype: torch.dtype | None = None) -> Rows:
    """Runs `term` over the inputs' rows, `rows` at a time (autocast off: a term picks its dtypes; no
    autograd graph: the gradients are the term's). `grad_dtype`: the row gradients' (the plain head's
    compute dtype); None: each row input's. No row at all still runs one empty chunk, so that every value
    has its dtype."""
    n, need_grad, flat = inputs.count(), inputs.need_grad(), inputs.flat()
    dev = flat[0].device
    grads = tuple(torch.empty(n, x.shape[-1], dtype=grad_dtype or x.dtype, device=dev) for x in flat) \
        if need_grad else ()
    shared = tuple(torch.zeros_like(s) for s in inputs.shared) if need_grad else ()
    loss, values = torch.zeros((), dtype=torch.float32, device=dev), None
    with torch.no_grad(), torch.autocast(dev.type, enabled=False):
        for i in range(0, max(n, 1), rows):
            sl = slice(i, min(n, i + rows))
            at = sl if inputs.index is None else inputs.index[sl]
            out = term(Chunk(sl, tuple(x[at] for x in flat), need_grad))
            loss += out.loss
            values = _gathered(values, out.values, sl, n)
            for buf, g in zip(grads, out.grads):
                buf[sl] = g
            for buf, (x, y) in zip(shared, out.shared):
                buf.addmm_(x, y)
            del out  # its (r, V) buffers (a shared gradient's factor) must not live into the next chunk's
    return Rows(loss, values, grads, shared)


def _gathered(bufs, vals: tuple, sl: slice, n: int) -> tuple:
    """The value buffers (allocated at the first chunk, of its dtypes) with this chunk's rows written."""
    if bufs is None:
        fresh = [None if v is None else v.new_empty((n, *v.shape[1:])) for v in vals]
        bufs = vals._make(fresh) if hasattr(vals, "_make") else tuple(fresh)
    for buf, v in zip(bufs, vals):
        if v is not None:
            buf[sl] = v
    return bufs


def rescaled(out: Rows, loss: torch.Tensor, scale: torch.Tensor) -> Rows:
    """`out` with a new loss and every row's gradient times scale (n,): a reweighing known only once
    every row's loss is (D-PACE's weights); each row's gradient is linear in its weight, so no recompute."""
    for g in out.grads:
        g.mul_(scale[:, None].to(g.dtype))
    return out._replace(loss=loss)


def with_gradients(out: Rows, inputs: RowInputs) -> torch.Tensor:
    """`out.loss`, differentiable in `inputs` by the gradients `chunk_rows` kept (as it is where none
    is needed)."""
    if not out.grads and not out.shared:
        return out.loss
    return _KeptGradients.apply(inputs.index, len(inputs.rows), out.loss, *inputs.rows, *inputs.shared,
                                *out.grads, *out.shared)


class _KeptGradients(torch.autograd.Function):
    """The loss, whose backward is the gradients computed with it (row inputs', scattered back to their
    rows with an index; shared inputs'), each times the incoming gradient. Saves those gradients and the
    index only."""

    @staticmethod
    def forward(ctx, index, num_rows: int, loss, *tensors):
        inputs, grads = tensors[:len(tensors) // 2], tensors[len(tensors) // 2:]
        ctx.num_rows = num_rows
        ctx.meta = [(x.shape, x.dtype) for x in inputs[:num_rows]]
        ctx.save_for_backward(index, *grads)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        index, *grads = ctx.saved_tensors
        out = []
        for g, (shape, dtype) in zip(grads[:ctx.num_rows], ctx.meta):
            d = (g * grad_loss).to(dtype)
            if index is not None:
                whole = torch.zeros(shape, dtype=dtype, device=g.device)
                whole.view(-1, shape[-1]).index_copy_(0, index, d)
                d = whole
            out.append(d)
        out += [g * grad_loss for g in grads[ctx.num_rows:]]
        return None, None, None, *out, *([None] * len(grads))


# -- per-chunk pieces more than one term uses --------------------------------------------------------

def rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """<x_r, y_r> per row as a batched matmul: no (r, V) product is made."""
    return (x[:, None, :] @ y[:, :, None])[:, 0, 0]


def l1_softmax_grad(q: torch.Tensor, s: torch.Tensor, l1_weight: float) -> torch.Tensor:
    """The L1 distance's gradient through the softmax, d(b ||q - p_t||_1)/dz = b q (s - <q, s>) for
    q = softmax(z), computed in place in s (r, V), which holds s = sign(q - p_t); returns it. A
    distillation's whole logit gradient is then a (q - p_t) + this (target_full's, Domino's)."""
    return s.sub_(rowdot(q, s)[:, None]).mul_(q).mul_(l1_weight)
