"""vLLM's CPU build: the thread setting both of the project's vLLM users (regeneration's engine,
data/regen/vllm.py, and the evaluation's, evaluation/vllm_engine.py) apply before an engine starts.

vLLM 0.32's CPU executor (vllm/utils/ompmultiprocessing.py, OMPProcessManager) binds the model worker's
OpenMP threads to the cores of one NUMA node and, on x86 and ARM, first takes `local_world_size` cores
(one per worker) out of that list for the engine-core (scheduler) process, unless
VLLM_CPU_NUM_OF_RESERVED_CPU says how many. On a 2-core machine the worker is left one core: its start-up
log reads `local_world_size=1, reserve_cpu_num=1, core ids=[0]`, and regeneration and evaluation run on
half the machine. VLLM_CPU_NUM_OF_RESERVED_CPU=0 binds the worker to every core of the node (`core
ids=[0, 1]`, OMP_NUM_THREADS=2); the scheduler process then shares them, which costs little because it
does little per step next to the model's forward. Measured on the 2-core machine: docs/benchmarks.md
("vLLM on CPU: one core or both", `python -m dflash_dist.bench.vllm_cores`).

The reservation is lifted only where it takes a large share of the machine (at most RESERVE_FREE_UP_TO
usable cores); on a larger host one core for the scheduler is vLLM's choice and stays. A value the user
set in the environment always wins.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
RESERVE_FREE_UP_TO = 4  # usable cores: where one reserved core is a quarter of the machine or more


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a cgroup or taskset limit counts)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_thread_env(cores: int, environ: dict) -> dict[str, str]:
    """The variables to set for a CPU engine on `cores` usable cores, given the environment (pure)."""
    if RESERVED in environ or cores > RESERVE_FREE_UP_TO:
        return {}
    return {RESERVED: "0"}


def apply_cpu_thread_env() -> None:
    """Set them in this process's environment: vLLM's engine-core process, started by the LLM
    constructor, inherits it. Call before building an LLM on CPU."""
    extra = cpu_thread_env(usable_cores(), dict(os.environ))
    if extra:
        log.info("vLLM on CPU: %s (the model worker gets all %d cores instead of %d)",
                 " ".join(f"{k}={v}" for k, v in extra.items()), usable_cores(), usable_cores() - 1)
    os.environ.update(extra)
