#!/usr/bin/env bash
# Set up, then run the test suite (CPU, gloo; multi-process tests use real processes with timeouts).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=1 REAL=1 bash launch/setup.sh  # the regeneration and evaluation tests run vLLM for real; REAL: the SmolLM2 target and data
bash launch/slurm_local.sh install  # slurm-wlm + munge (apt) where missing: tests/test_slurm.py starts a one-node cluster
exec .venv/bin/python -m pytest -q "$@"
