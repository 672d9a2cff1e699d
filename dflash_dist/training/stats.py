"""What drafters all-reduce after every step, as named fields with one place that packs them.

`StepStats` sums over drafters; rank 0 folds it into the run's totals and the monitor's progress.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Scalar fields in pack order; the per-slot vectors follow.
_SCALARS = ("loss_sum", "weight_sum", "tokens", "seqs", "accept_sum", "blocks", "batches", "wait_s", "compute_s",
            "save_due", "unary_accept_sum", "unary_blocks", "selector_loss_sum", "selector_blocks")
_COUNTS = {"tokens", "seqs", "blocks", "batches", "save_due", "unary_blocks", "selector_blocks"}  # the rest: float sums
_VECTORS = ("correct", "valid", "unary_correct", "topk_hits")  # one value per block slot each


@dataclass
class StepStats:
    block_size: int
    loss_sum: float | torch.Tensor = 0.0  # sum of w * ce over the step's trained slots
    weight_sum: float | torch.Tensor = 0.0
    tokens: int = 0
    seqs: int = 0
    accept_sum: float | torch.Tensor = 0.0  # accepted prefix (+1) summed over blocks
    blocks: int = 0
    batches: int = 0
    wait_s: float = 0.0  # cumulative seconds this drafter waited for packets (summed over drafters)
    compute_s: float = 0.0  # cumulative seconds of drafter compute
    save_due: int = 0  # rank 0: a periodic checkpoint is due after this step (every drafter gathers for it)
    # A variant whose drafts are not the plain LM head's argmax (DFlash 2: the selector's walk; Domino: the
    # base logits plus its delta): accept_sum and correct follow its drafts, the unary head's own figures come
    # beside; DFlash 2's selector term (before its weight) and its top-K's recall of the gold too.
    unary_accept_sum: float | torch.Tensor = 0.0
    unary_blocks: int = 0  # blocks the unary figures count (0: a DFlash run)
    selector_loss_sum: float | torch.Tensor = 0.0
    selector_blocks: int = 0  # blocks the selector drafted (0: a DFlash run)
    correct: torch.Tensor = field(default=None)  # (B,) hits per block slot
    valid: torch.Tensor = field(default=None)  # (B,) trained labels per slot
    unary_correct: torch.Tensor = field(default=None)  # (B,) hits of the unary argmax (DFlash 2, Domino)
    topk_hits: torch.Tensor = field(default=None)  # (B,) trained labels inside the unary top-K (DFlash 2)

    def __post_init__(self) -> None:
        for k in _VECTORS:
            if getattr(self, k) is None:
                setattr(self, k, torch.zeros(self.block_size, dtype=torch.float64))

    def take_metrics(self, m) -> None:
        """A batch's StepMetrics (device tensors stay on the device: packed there)."""
        self.loss_sum, self.weight_sum = m.loss_sum, m.weight_sum
        self.accept_sum, self.blocks = m.accept_sum, m.num_blocks
        self.correct, self.valid = m.correct, m.valid
        if m.unary_correct is not None:
            self.unary_accept_sum, self.unary_correct = m.unary_accept_sum, m.unary_correct
            self.unary_blocks = m.num_blocks
        if m.selector_loss_sum is not None:
            self.selector_loss_sum, self.topk_hits = m.selector_loss_sum, m.topk_hits
            self.selector_blocks = m.num_blocks

    def pack(self, device) -> torch.Tensor:
        """One float64 tensor on `device`. Fields may be device tensors (the step's metrics): they are
        gathered there, so the step reads nothing back to the host before its all-reduce; the host
        numbers go over in one copy."""
        vals = [getattr(self, k) for k in _SCALARS]
        head = torch.tensor([0.0 if torch.is_tensor(v) else float(v) for v in vals], dtype=torch.float64).to(device)
        on_device = [i for i, v in enumerate(vals) if torch.is_tensor(v)]
        if on_device:
            head[on_device] = torch.stack([vals[i].to(device, torch.float64).reshape(()) for i in on_device])
        return torch.cat([head] + [getattr(self, k).to(device, torch.float64) for k in _VECTORS])

    @classmethod
    def unpack(cls, t: torch.Tensor, block_size: int) -> "StepStats":
        t = t.cpu()
        n, B = len(_SCALARS), block_size
        vals = {k: (int(t[i]) if k in _COUNTS else float(t[i])) for i, k in enumerate(_SCALARS)}
        vecs = {k: t[n + i * B:n + (i + 1) * B].clone() for i, k in enumerate(_VECTORS)}
        return cls(block_size=B, **vecs, **vals)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum > 0 else float("nan")

    def accuracy(self) -> list[float]:
        """Per drafting slot (`drafting_slots`)."""
        first = drafting_slots(self.valid)
        return (self.correct[first:] / self.valid[first:].clamp(min=1)).tolist()

    def head_figures(self) -> dict:
        """The unary head's figures beside the drafts' where they differ (empty for DFlash and DSpark):
        `unary_acc`, `unary_accept_len`; DFlash 2's `topk_recall` (trained labels in the unary top-K) and
        `selector_loss` too."""
        first = drafting_slots(self.valid)
        labels = float(self.valid[first:].sum())
        ratio = (lambda x: float(x[first:].sum()) / labels) if labels else (lambda x: float("nan"))
        out = {}
        if self.unary_blocks:
            out.update(unary_acc=ratio(self.unary_correct), unary_accept_len=self.unary_accept_sum / self.unary_blocks)
        if self.selector_blocks:
            out.update(topk_recall=ratio(self.topk_hits),
                       selector_loss=self.selector_loss_sum / self.weight_sum if self.weight_sum > 0 else float("nan"))
        return out


def drafting_slots(valid) -> int:
    """The first slot whose accuracy is reported: 1 where slot 0 never has a label (DFlash's given
    anchor token), 0 where it does (DSpark's anchor-as-first blocks: slot 0 drafts the next token)."""
    return 0 if float(valid[0]) > 0 else 1


class Diverged(RuntimeError):
    """Raised alike on every drafter (the decision follows all-reduced values)."""
