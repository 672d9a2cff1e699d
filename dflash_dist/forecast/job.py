"""The job as both forecasts see it: one batch's shape, how a role's state is divided over ranks, and the
element sizes and paths of the device (`forecast.memory`, `forecast.cost`, each variant's forecast terms)."""
from __future__ import annotations

from dataclasses import dataclass

from dflash_dist.config import Config


@dataclass(frozen=True)
class BatchShape:
    """One batch as the memory model sees it. seq_lens/seq_anchors (per sequence) and anchor_pos (each
    anchor's offset in its sequence, grouped by sequence) serve the "sdpa" attention term; without
    anchor_pos every anchor is taken to see its whole sequence (an upper bound)."""
    tokens: int
    seqs: int
    anchors: int
    seq_lens: tuple[int, ...] = ()
    seq_anchors: tuple[int, ...] = ()
    anchor_pos: tuple[int, ...] = ()

    def summary(self) -> dict:
        return {"tokens": self.tokens, "seqs": self.seqs, "anchors": self.anchors}


@dataclass(frozen=True)
class Sharding:
    """How a role's state is divided over ranks: tensor_parallel ranks per target replica share its
    weights and activations; with fsdp the drafters share parameters, gradients and optimizer state."""
    tensor_parallel: int = 1
    drafters: int = 1
    fsdp: bool = False
    # torch DDP's flat gradient buckets as a second copy of the gradients. The drafter role's DDP has
    # gradient_as_bucket_view and zeroes the gradients in place (parallel/sharding.py): its buckets are the
    # gradients, so off.
    ddp: bool = False
    drafters_per_target: int = 1  # drafters one target replica sends to (its packets in flight)

    @classmethod
    def from_config(cls, cfg: Config, num_drafters: int | None = None) -> "Sharding":
        fsdp = cfg.roles.drafter_sharding == "fsdp"
        return cls(tensor_parallel=cfg.model.target.tensor_parallel,
                   drafters=num_drafters or cfg.roles.drafters_per_node, fsdp=fsdp,
                   drafters_per_target=cfg.roles.drafters_per_node)


@dataclass(frozen=True)
class Precision:
    """Element sizes and paths of the device the job runs on."""
    device: str = "cuda"
    target_bytes: int = 2  # target weights and activations (model.target.dtype)
    transfer_bytes: int = 2  # features on the wire (transport.dtype)
    drafter_compute: int = 2  # drafter matmuls: bf16 under autocast on CUDA, fp32 on CPU
    attention: str = "flex"  # drafter block attention path: flex | sdpa

    @property
    def autocast(self) -> bool:
        return self.drafter_compute != 4

    @classmethod
    def from_config(cls, cfg: Config, device: str = "cuda", attention: str | None = None) -> "Precision":
        size = {"float32": 4, "bfloat16": 2, "float16": 2}
        auto = 2 if device == "cuda" else 4
        tb = auto if cfg.model.target.dtype == "auto" else size[cfg.model.target.dtype]
        xb = tb if cfg.transport.dtype == "auto" else size[cfg.transport.dtype]
        return cls(device=device, target_bytes=tb, transfer_bytes=xb, drafter_compute=auto,
                   attention=attention or ("flex" if device == "cuda" else "sdpa"))
