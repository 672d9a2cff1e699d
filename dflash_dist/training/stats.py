"""What drafters all-reduce after every step, as named fields with one place that packs them.

`StepStats` sums over drafters; rank 0 folds it into the run's totals and the monitor's progress.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

# Scalar fields in pack order; `correct` and `valid` (one per block slot) follow.
_SCALARS = ("loss_sum", "weight_sum", "tokens", "seqs", "accept_sum", "blocks", "batches", "wait_s", "compute_s",
            "save_due")
_COUNTS = {"tokens", "seqs", "blocks", "batches", "save_due"}  # integers; the rest are sums of floats


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

    def __post_init__(self) -> None:
        if self.correct is None:
            self.correct = torch.zeros(self.block_size, dtype=torch.float64)
        if self.valid is None:
            self.valid = torch.zeros(self.block_size, dtype=torch.float64)

    def pack(self, device) -> torch.Tensor:
        """One float64 tensor on `device`. Fields may be device tensors (the step's metrics): they are
        gathered there, so the step reads nothing back to the host before its all-reduce; the host
        numbers go over in one copy."""
        vals = [getattr(self, k) for k in _SCALARS]
        head = torch.tensor([0.0 if torch.is_tensor(v) else float(v) for v in vals], dtype=torch.float64).to(device)
        on_device = [i for i, v in enumerate(vals) if torch.is_tensor(v)]
        if on_device:
            head[on_device] = torch.stack([vals[i].to(device, torch.float64).reshape(()) for i in on_device])
        return torch.cat([head, self.correct.to(device, torch.float64), self.valid.to(device, torch.float64)])

    @classmethod
    def unpack(cls, t: torch.Tensor, block_size: int) -> "StepStats":
        t = t.cpu()
        n, B = len(_SCALARS), block_size
        vals = {k: (int(t[i]) if k in _COUNTS else float(t[i])) for i, k in enumerate(_SCALARS)}
        return cls(block_size=B, correct=t[n:n + B].clone(), valid=t[n + B:n + 2 * B].clone(), **vals)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum > 0 else float("nan")

    def accuracy(self) -> list[float]:
        """Per slot k >= 1 (slot 0 is the given anchor token)."""
        return (self.correct[1:] / self.valid[1:].clamp(min=1)).tolist()


class Diverged(RuntimeError):
    """Raised alike on every drafter (the decision follows all-reduced values)."""


def device_clock(device: torch.device):
    """A clock for wait/compute accounting. On CUDA kernels and NCCL waits are asynchronous: the CPU
    returns before the work is done, so each reading first waits for the current stream; one reading
    per stage boundary (a handful per step) is what true accounting costs."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()
    return now
