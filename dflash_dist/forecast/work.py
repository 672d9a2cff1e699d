"""Units of work and the devices that do them: the cost model's vocabulary (`forecast.cost`).

A `Term` is an amount of one kind of work (FLOPs of a compute kind, or bytes); a `Device` says how many
units of each kind it does per second at its peak and an `Efficiency` what share of that peak each kind
reaches; a role's batch (`RoleCost`) is a sum of named terms, and its seconds follow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# `Term` is defined beside the variants' forecast interface, whose terms build them (models/ may not
# import forecast/); the cost model and its users import it from here all the same.
from dflash_dist.models.variants.forecast import Term

COMPUTE = ("matmul", "causal_attention", "block_attention")
KINDS = COMPUTE + ("memory", "link", "network")


@dataclass(frozen=True)
class Device:
    """Peaks of one accelerator: dense TFLOP/s of the compute dtype (bf16 on GPUs), HBM GB/s, GB/s to
    another GPU of the node (one direction) and to another node (per GPU)."""
    name: str
    tflops: float
    mem_gbs: float
    link_gbs: float
    net_gbs: float

    def rate(self, kind: str) -> float:
        """Units (FLOPs or bytes) per second of `kind` at 100% efficiency."""
        if kind in COMPUTE:
            return self.tflops * 1e12
        return {"memory": self.mem_gbs * 1e9, "link": self.link_gbs * 1e9, "network": self.net_gbs * 1e9}[kind]


# NVIDIA's datasheets: H100 SXM and H200 989 TFLOP/s dense bf16 (1,979 with sparsity), HBM 3.35 and
# 4.8 TB/s, NVLink 900 GB/s both directions; 8 x 400 Gb/s NICs per node = 50 GB/s per GPU between nodes.
# "cpu" is nominal (a CPU run's start-of-run line): its seconds mean little, its split something.
DEVICES = {
    "h100": Device("H100 SXM", 989.0, 3350.0, 450.0, 50.0),
    "h200": Device("H200", 989.0, 4800.0, 450.0, 50.0),
    "cpu": Device("CPU (nominal)", 0.1, 20.0, 10.0, 1.0),
}


@dataclass(frozen=True)
class Efficiency:
    """Share of the peak each kind of work reaches (assumed until a GPU check measures it)."""
    matmul: float = 0.6
    causal_attention: float = 0.4  # flash-attn varlen (or flex) forward
    block_attention: float = 0.3  # flex forward and backward over small blocks
    memory: float = 0.7
    link: float = 0.6
    network: float = 0.7

    def of(self, kind: str) -> float:
        return getattr(self, kind)


@dataclass
class RoleCost:
    terms: dict[str, Term]

    def seconds(self, dev: Device, eff: Efficiency, exclude: Sequence[str] = ()) -> float:
        return sum(t.amount / (dev.rate(t.kind) * eff.of(t.kind)) for n, t in self.terms.items() if n not in exclude)

    def by_term(self, dev: Device, eff: Efficiency) -> dict[str, float]:
        return {n: t.amount / (dev.rate(t.kind) * eff.of(t.kind)) for n, t in self.terms.items()}

    @property
    def flops(self) -> float:
        return sum(t.amount for t in self.terms.values() if t.kind in COMPUTE)

    @property
    def bytes(self) -> float:
        """Bytes moved: element-wise work's, and between GPUs."""
        return sum(t.amount for t in self.terms.values() if t.kind not in COMPUTE)

    @property
    def useful_flops(self) -> float:
        return sum(t.amount if t.useful is None else t.useful for t in self.terms.values() if t.kind in COMPUTE)
