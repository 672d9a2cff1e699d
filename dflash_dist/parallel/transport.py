"""Feature packets from target to drafter over point-to-point isend/irecv.

A packet is three contiguous tensors, sent in this order on the data backend's device:
  header   int64 (HEADER_LEN,): magic, epoch, batch, tokens, seqs, feature dim, sender compute/wait us
  meta     int64 (2N + S + 1,): token ids | loss mask | cu_seqlens
  features (N, F) in the transfer dtype: the captured layers concatenated on the feature axis (and, where
           `sends_final_hidden`: a variant that asks or objective.labels=target_full, the target's
           final-normed last state after them)
With the target's predictions as labels (target_argmax, target_soft) they ride along (TargetLabels):
  meta     int64 (2N + S + 1 + wN,): ... | the target's ids per token, row-major (N, w): w = 1 for
           target_argmax (its argmax), w = k for target_soft (its top-k indices, best first)
  values   float32 (N, k), target_soft only, a 4th tensor after the features: the matching top-k logits
           (float32 whatever the transfer dtype: the softmax over them is the training target)
w and k follow from the config, which every rank shares, so the receiver still sizes everything from the
plan; with data labels (and target_full, whose distribution the drafter computes from the final state)
the packet is exactly the three tensors above.

Every rank holds the plan, so the receiver sizes all three buffers before the bytes arrive and posts
them ahead of need (prefetch). It checks the header before it touches the payload and raises
PacketError naming the sender on any mismatch. A sender keeps at most `max_in_flight` packets
outstanding per drafter: a Qwen3-8B batch is ~2 GB of features, so an unbounded queue is an OOM.
Nothing is pickled.

On CPU a receiver may take its feature buffers from its own `RecvPool` instead of fresh allocations: a
fresh tensor above glibc's mmap threshold (32 MiB at most) is fresh pages, and touching them for the
first time cost more than the copy off the socket (docs/benchmarks.md, transport). The receiver gives a
buffer back once the step that used it is done. CUDA tensors need no pool: the caching allocator is one.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_dist.config import Config
from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.build import compute_dtype
from dflash_dist.models.drafter import DraftSpec

MAGIC = 0x0DF1A5
HEADER_LEN = 8


class PacketError(RuntimeError):
    pass


class RecvPool:
    """Reusable flat CPU byte buffers for one receiver's feature packets. `take` hands a buffer out; the
    receiver gives it back (`give_back`) once the packet is consumed, i.e. after the step whose backward
    used it, so a buffer in use is never handed out again. At most `max_buffers` idle ones are kept;
    when none is large enough, the largest idle one is dropped rather than held beside a new one."""

    def __init__(self, max_buffers: int = 8):
        self.max_buffers = max_buffers
        self.idle: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self.idle if b.numel() >= nbytes]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            self.idle = [b for b in self.idle if b is not buf]  # by identity: `remove` compares elementwise
            return buf[:nbytes]
        if self.idle:  # none large enough: drop the largest idle one rather than hold both
            victim = max(self.idle, key=torch.Tensor.numel)
            self.idle = [b for b in self.idle if b is not victim]
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back(self, t: torch.Tensor) -> None:
        """Return the buffer behind `t` (a tensor `take` made, or a view of it)."""
        storage = t.untyped_storage()
        base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        if len(self.idle) < self.max_buffers:
            self.idle.append(base)


def _recv_buffer(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                 pool: RecvPool | None) -> torch.Tensor:
    if pool is None or torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    return pool.take(nbytes).view(dtype).view(shape)


@dataclass(frozen=True)
class PacketSpec:
    """What both ends of the wire agree on, computed once from the config: feature width and transfer
    dtype, target label ids per token (0 with data labels) and whether top-k values follow. A batch's
    token and sequence counts come from the plan (`shape`), so the receiver sizes buffers before any byte."""
    feat_dim: int
    dtype: torch.dtype
    label_width: int = 0
    soft: bool = False

    def shape(self, lengths, indices) -> tuple[int, int]:
        """(tokens, sequences) of the batch made of these samples."""
        return int(lengths[indices].sum()), len(indices)

    def meta_numel(self, n_tokens: int, n_seqs: int) -> int:
        """int64 elements of a packet's meta: ids | loss mask | cu_seqlens | the target's ids per token."""
        return (2 + self.label_width) * n_tokens + n_seqs + 1

    def nbytes(self, n_tokens: int, n_seqs: int) -> int:
        """Bytes of a whole packet (header, meta, features, soft values) of that batch shape."""
        soft = 4 * self.label_width * n_tokens if self.soft else 0
        return (8 * (HEADER_LEN + self.meta_numel(n_tokens, n_seqs)) + soft
                + n_tokens * self.feat_dim * torch.empty(0, dtype=self.dtype).element_size())


def target_label_width(labels: str, soft_top_k: int) -> int:
    """Target ids sent per token: 0 for data labels, 1 (the argmax) or the top-k indices; 0 for
    target_full, whose labels the drafter reads off the distribution it computes (its top-1). A target
    computes logits for its packets exactly when this is > 0."""
    return {"data": 0, "target_argmax": 1, "target_soft": soft_top_k, "target_full": 0}[labels]


def sends_final_hidden(labels: str, variant_asks: bool) -> bool:
    """The one rule for the target's final-normed last hidden state as one more H-wide block of each
    token's features: a variant asks for it (`Variant.needs.final_hidden`: DSpark's teacher), or the
    labels are target_full (the drafter's teacher distribution, softmax(lm_head(last))). The packet's width
    (`packet_spec`), the capture (training/capture.py, for every caller: the roles, the benchmarks) and the
    forecasts (forecast/memory.py `feature_blocks`, `runs_whole_target`) all read it here."""
    return variant_asks or labels == "target_full"


def packet_spec(cfg: Config, spec: DraftSpec, device: torch.device) -> PacketSpec:
    """The one packet specification of a run (sender and receiver both build it from the config)."""
    t = cfg.transport.dtype
    dtype = compute_dtype(cfg.model.target.dtype if t == "auto" else t, device)
    # The target's final-normed hidden state as one more H-wide block (DSpark's teacher; target_full's).
    blocks = len(spec.target_layer_ids) + int(sends_final_hidden(cfg.objective.labels,
                                                                 spec.family.needs.final_hidden))
    return PacketSpec(feat_dim=blocks * spec.hidden_size, dtype=dtype,
                      label_width=target_label_width(cfg.objective.labels, cfg.objective.soft_top_k),
                      soft=cfg.objective.labels == "target_soft")


@dataclass
class TargetLabels:
    """The target's own predictions for the next token at each packed position (distillation labels)."""
    ids: torch.Tensor  # (N, w) int64: argmax (w = 1) or top-k indices, best first
    values: torch.Tensor | None = None  # (N, k) float32 top-k logits for soft labels; None for argmax


@dataclass
class Packet:
    epoch: int
    batch: int
    batch_data: PackedBatch
    features: torch.Tensor
    sender_compute_s: float
    sender_wait_s: float
    target: TargetLabels | None = None  # None with objective.labels=data


def _header(epoch, batch, n_tokens, n_seqs, feat_dim, compute_s=0.0, wait_s=0.0, device="cpu"):
    return torch.tensor([MAGIC, epoch, batch, n_tokens, n_seqs, feat_dim, int(compute_s * 1e6), int(wait_s * 1e6)],
                        dtype=torch.int64, device=device)


class PacketSender:
    """blocking: on NCCL `work.wait()` only makes the current stream wait, so the CPU would not see the
    time a send takes; with blocking the sender also waits for the stream, and `wait_s` is true time."""

    def __init__(self, max_in_flight: int, group=None, blocking: bool = False):
        self.max_in_flight = max_in_flight
        self.group = group
        self.blocking = blocking
        self.queues: dict[int, deque] = {}
        self.wait_s = 0.0  # time blocked on the in-flight bound

    def _complete(self, works) -> None:
        for w in works:
            w.wait()
        if self.blocking:
            torch.cuda.current_stream().synchronize()

    def send(self, dst: int, epoch: int, batch: int, data: PackedBatch, features: torch.Tensor,
             compute_s: float, wait_s: float, target: TargetLabels | None = None) -> None:
        q = self.queues.setdefault(dst, deque())
        t0 = time.perf_counter()
        while len(q) >= self.max_in_flight:
            self._complete(q.popleft()[0])
        self.wait_s += time.perf_counter() - t0
        dev = features.device
        n, s = data.num_tokens, data.num_seqs
        header = _header(epoch, batch, n, s, features.shape[1], compute_s, wait_s, dev)
        parts = [data.input_ids, data.loss_mask.long(), data.cu_seqlens]
        if target is not None:
            parts.append(target.ids.reshape(-1))
        meta = torch.cat(parts).to(dev)
        tensors = (header, meta, features.contiguous())
        if target is not None and target.values is not None:
            tensors += (target.values.float().contiguous().to(dev),)
        works = [dist.isend(t, dst, group=self.group) for t in tensors]
        q.append((works, tensors))  # the tensors must live until their send completes

    def flush(self) -> None:
        t0 = time.perf_counter()
        for q in self.queues.values():
            while q:
                self._complete(q.popleft()[0])
        self.wait_s += time.perf_counter() - t0


class PendingPacket:
    """label_width: target ids per token in meta (0 = data labels); soft: a (N, label_width) float32
    values tensor follows the features (see the module docstring)."""

    def __init__(self, src, epoch, batch, n_tokens, n_seqs, feat_dim, dtype, device, group=None,
                 label_width: int = 0, soft: bool = False, pool: RecvPool | None = None):
        self.src, self.expect = src, (MAGIC, epoch, batch, n_tokens, n_seqs, feat_dim)
        self.label_width = label_width
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        self.meta = torch.empty(PacketSpec(feat_dim, dtype, label_width, soft).meta_numel(n_tokens, n_seqs),
                                dtype=torch.int64, device=device)
        self.features = _recv_buffer((n_tokens, feat_dim), dtype, device, pool)
        tensors = [self.header, self.meta, self.features]
        # Small next to the features (k floats per token): a fresh buffer, not the pool's.
        self.values = torch.empty(n_tokens, label_width, dtype=torch.float32, device=device) if soft else None
        if self.values is not None:
            tensors.append(self.values)
        self.works = [dist.irecv(t, src, group=group) for t in tensors]

    def wait(self) -> Packet:
        self.works[0].wait()
        got = tuple(int(x) for x in self.header[:6].tolist())
        if got != self.expect:
            names = ("magic", "epoch", "batch", "tokens", "seqs", "feature_dim")
            diff = ", ".join(f"{k}: expected {e}, got {g}" for k, e, g in zip(names, self.expect, got) if e != g)
            raise PacketError(f"packet from target rank {self.src} does not match the plan ({diff}); "
                              "refusing to train on the wrong batch")
        for w in self.works[1:]:
            w.wait()
        n, s = self.expect[3], self.expect[4]
        end = 2 * n + s + 1  # cu_seqlens ends the base meta; target ids (if any) follow
        data = PackedBatch(self.meta[:n], self.meta[n:2 * n].bool(), self.meta[2 * n:end])
        target = None
        if self.label_width:
            target = TargetLabels(self.meta[end:].view(n, self.label_width), self.values)
        compute_us, wait_us = self.header[6:8].tolist()
        return Packet(self.expect[1], self.expect[2], data, self.features, compute_us / 1e6, wait_us / 1e6, target)
