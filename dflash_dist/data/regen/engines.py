"""Which engine a regeneration runs, and building it: kept apart from engine.py (the interface both
engines implement), so the interface never imports its implementations."""
from __future__ import annotations

from dflash_dist.data.regen.engine import Engine, EngineSpec


def default_engine() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "hf"
    return "vllm"


def build_engine(spec: EngineSpec, stop_ids: list[int], local_rank: int = 0) -> Engine:
    if spec.name == "vllm":
        from dflash_dist.data.regen.vllm import VllmEngine
        return VllmEngine(spec, stop_ids, local_rank)
    if spec.name == "hf":
        from dflash_dist.data.regen.hf import HfEngine
        return HfEngine(spec, stop_ids, local_rank)
    raise ValueError(f"--engine must be vllm or hf, got {spec.name!r}")
