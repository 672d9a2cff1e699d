"""What drafters all-reduce after every step, as named fields with one place that packs them.

`StepStats` sums over drafters; rank 0 folds it into the run's totals and the monitor's progress. A
variant's own figures (`models.variants.base.Figures`) ride along by name in `sums`, after the fixed
fields in the order the variant declares them, so no field here is any variant's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_dist.models.variants.base import Figures

# Scalar fields in pack order; the per-slot vectors follow, then the variant's declared sums.
_SCALARS = ("loss_sum", "weight_sum", "tokens", "seqs", "accept_sum", "blocks", "batches", "wait_s", "compute_s",
            "save_due")
_COUNTS = {"tokens", "seqs", "blocks", "batches", "save_due"}  # the rest: float sums
_VECTORS = ("correct", "valid")  # one value per block slot each


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
    correct: torch.Tensor = field(default=None)  # (B,) hits per block slot
    valid: torch.Tensor = field(default=None)  # (B,) trained labels per slot
    # The variant's declared figures (`Variant.figures`) and their sums by name: a scalar (float or ()
    # tensor) or a (B,) vector each; zeros until a batch's metrics come (an idle drafter's stay zero).
    figures: Figures = Figures()
    sums: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in _VECTORS:
            if getattr(self, k) is None:
                setattr(self, k, torch.zeros(self.block_size, dtype=torch.float64))
        for k in self.figures.scalars:
            self.sums.setdefault(k, 0.0)
        for k in self.figures.slots:
            self.sums.setdefault(k, torch.zeros(self.block_size, dtype=torch.float64))

    def take_metrics(self, m) -> None:
        """A batch's StepMetrics (device tensors stay on the device: packed there). Its `sums` must be
        the declared figures' exactly: one missing would report zeros, one undeclared would vanish."""
        if set(m.sums) != set(self.figures.names):
            raise ValueError(f"the variant's loss term returned the sums {sorted(m.sums)}, its figures declare "
                             f"{sorted(self.figures.names)} (Variant.figures)")
        self.loss_sum, self.weight_sum = m.loss_sum, m.weight_sum
        self.accept_sum, self.blocks = m.accept_sum, m.num_blocks
        self.correct, self.valid = m.correct, m.valid
        self.sums = dict(m.sums)

    def pack(self, device) -> torch.Tensor:
        """One float64 tensor on `device`. Fields may be device tensors (the step's metrics): they are
        gathered there, so the step reads nothing back to the host before its all-reduce; the host
        numbers go over in one copy."""
        vals = [getattr(self, k) for k in _SCALARS] + [self.sums[k] for k in self.figures.scalars]
        head = torch.tensor([0.0 if torch.is_tensor(v) else float(v) for v in vals], dtype=torch.float64).to(device)
        on_device = [i for i, v in enumerate(vals) if torch.is_tensor(v)]
        if on_device:
            head[on_device] = torch.stack([vals[i].to(device, torch.float64).reshape(()) for i in on_device])
        vecs = [getattr(self, k) for k in _VECTORS] + [self.sums[k] for k in self.figures.slots]
        return torch.cat([head] + [v.to(device, torch.float64) for v in vecs])

    @classmethod
    def unpack(cls, t: torch.Tensor, block_size: int, figures: Figures = Figures()) -> "StepStats":
        """`pack`'s tensor (summed over drafters) back, for a variant that declares `figures`."""
        t = t.cpu()
        n, B = len(_SCALARS) + len(figures.scalars), block_size
        vals = {k: (int(t[i]) if k in _COUNTS else float(t[i])) for i, k in enumerate(_SCALARS)}
        sums = {k: float(t[len(_SCALARS) + i]) for i, k in enumerate(figures.scalars)}
        vecs = [t[n + i * B:n + (i + 1) * B].clone() for i in range(len(_VECTORS) + len(figures.slots))]
        sums.update(zip(figures.slots, vecs[len(_VECTORS):]))
        return cls(block_size=B, **dict(zip(_VECTORS, vecs)), **vals, figures=figures, sums=sums)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum > 0 else float("nan")

    def accuracy(self) -> list[float]:
        """Per drafting slot (`drafting_slots`)."""
        first = drafting_slots(self.valid)
        return (self.correct[first:] / self.valid[first:].clamp(min=1)).tolist()

    # -- a variant's figures of the reduced stats (`Variant.reported_figures`) -------------------------
    def slot_ratio(self, name: str) -> float:
        """A declared per-slot sum over the drafting slots' trained labels (nan without any): a rate per
        label, as `acc` is."""
        first = drafting_slots(self.valid)
        labels = float(self.valid[first:].sum())
        return float(self.sums[name][first:].sum()) / labels if labels else float("nan")

    def per_block(self, name: str) -> float:
        """A declared scalar sum per block (nan without any): a mean over blocks, as `accept_len` is."""
        return self.sums[name] / self.blocks if self.blocks else float("nan")

    def per_weight(self, name: str) -> float:
        """A declared scalar sum over the weight sum (nan at 0): a weighted mean loss, as `loss` is."""
        return self.sums[name] / self.weight_sum if self.weight_sum > 0 else float("nan")


def drafting_slots(valid) -> int:
    """The first slot whose accuracy is reported: 1 where slot 0 never has a label (DFlash's given
    anchor token), 0 where it does (DSpark's anchor-as-first blocks: slot 0 drafts the next token)."""
    return 0 if float(valid[0]) > 0 else 1


class Diverged(RuntimeError):
    """Raised alike on every drafter (the decision follows all-reduced values)."""
