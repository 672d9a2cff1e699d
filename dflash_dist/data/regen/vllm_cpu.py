"""vLLM's CPU build: how it binds its threads, said in one place for both of the project's vLLM users
(regeneration's engine, data/regen/vllm.py, and the evaluation's, evaluation/vllm_engine.py).

vLLM 0.32's CPU executor (vllm/utils/ompmultiprocessing.py, OMPProcessManager) binds the model worker's
OpenMP threads to the cores of one NUMA node and, on x86 and ARM, first takes `local_world_size` cores
(one per worker) out of that list for the engine-core (scheduler) process, unless
VLLM_CPU_NUM_OF_RESERVED_CPU says how many. On a 2-core machine the worker is left one core (start-up log:
`local_world_size=1, reserve_cpu_num=1, core ids=[0]`). VLLM_CPU_NUM_OF_RESERVED_CPU=0 binds it to both
(`core ids=[0, 1]`, OMP_NUM_THREADS=2), but measured on the shared 2-core machine that was slower, not
faster: regeneration's target-only decoding 0.35x, the evaluation's n-gram decoding 0.91x of the
one-core rate (`python -m dflash_dist.bench.vllm_cores`, docs/benchmarks.md): the two bound OpenMP
threads wait for each other whenever the scheduler process or another job takes one of the cores. So
vLLM's default stays; what it does is logged where it matters (a small machine), with the variable that
changes it, and a value the user sets is left alone.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
NOTE_UP_TO = 4  # usable cores: where the one reserved core is a quarter of the machine or more


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a cgroup or taskset limit counts)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def binding_note(cores: int, environ: dict) -> str | None:
    """What vLLM's CPU engine will do with `cores` usable cores, when worth saying (pure)."""
    if RESERVED in environ or cores > NOTE_UP_TO:
        return None
    return (f"vLLM on CPU binds its model worker to {cores - 1} of the {cores} cores and keeps 1 for its "
            f"scheduler ({RESERVED}=0 gives the worker all {cores}: measured slower on a shared 2-core "
            "machine, docs/benchmarks.md)")


def note_cpu_binding() -> None:
    """Log it before building an LLM on CPU."""
    note = binding_note(usable_cores(), dict(os.environ))
    if note:
        log.info("%s", note)
