#!/usr/bin/env bash
# Create .venv (inside the repo, ignored by git) and install dflash_dist with its test tools.
# torch: on a machine without CUDA the CPU build; on a GPU machine whatever CUDA build pip picks.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.6.0"). Idempotent: a second call is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then spec=$TORCH_SPEC
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then spec="torch"
  else spec="torch==2.13.0"  # this version's CPU wheel is what the project's CPU machines carry
  fi
  .venv/bin/pip install -q --disable-pip-version-check "$spec"
fi
# EXTRAS: dev (default) = pytest + transformers/tokenizers for the tests; "" = the package alone.
extras=${EXTRAS-dev}
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
