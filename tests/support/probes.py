"""Dispatch probes: what a computation makes, op by op, for the memory tests of the chunked losses."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestWithVocab(TorchDispatchMode):
    """The most rows of any tensor an op makes whose last dimension is the vocabulary `vocab`: a loss that
    works in row chunks never makes more than a chunk's. Views of the given weights (the frozen head's,
    a variant's V x r or V x E projection, transposed for a matmul) are theirs, not a made tensor."""

    def __init__(self, vocab: int, *weights: torch.Tensor):
        super().__init__()
        self.vocab, self.rows = vocab, 0
        self.skip = {w.untyped_storage().data_ptr() for w in weights}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab \
                    and t.untyped_storage().data_ptr() not in self.skip:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


class LargestOutput(TorchDispatchMode):
    """The largest new tensor any op produces (numel), forward and backward; views of an input are not new."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out
