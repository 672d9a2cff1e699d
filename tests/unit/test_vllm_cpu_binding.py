"""vLLM's CPU thread binding note (data/regen/vllm_cpu.py) on small machines, without vLLM."""
from __future__ import annotations

from dflash_dist.data.regen.vllm_cpu import RESERVED, binding_note


def test_small_machines_are_told_how_vllm_binds_its_threads():
    note = binding_note(2, {})
    assert "1 of the 2 cores" in note and f"{RESERVED}=0" in note and "docs/benchmarks.md" in note
    assert "3 of the 4 cores" in binding_note(4, {"OMP_NUM_THREADS": "1"})
    assert binding_note(2, {RESERVED: "0"}) is None  # the user chose: nothing to say
    assert binding_note(16, {}) is None  # one reserved core of many
