#!/usr/bin/env bash
# The one place that starts torchrun: demo.sh calls it on one machine, slurm/train.sbatch once per node.
#   one node : NPROC ranks (default 3), --standalone rendezvous
#   N nodes  : NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID from the caller; c10d rendezvous hosted by the
#              agent on MASTER_ADDR (the first node); NODE_RANK only orders the logs (c10d assigns ranks)
# MAX_RESTARTS: torchrun restarts the whole group after a failure; train.resume=auto picks up the
# newest checkpoint by itself. DRY_RUN=1 prints the command (with the environment it sets) instead.
#
# SHUTDOWN_TIMEOUT (seconds, default 300): when the torchrun agent gets SIGTERM (a Slurm stop, a kill),
# it forwards the signal to its workers and SIGKILLs them after this grace period, 30 s unless told
# otherwise: torch.distributed.run's --shutdown-timeout (LaunchConfig.shutdown_timeout, passed to the
# agent's _shutdown -> PContext.close(SIGTERM, timeout); in the torch this project installs, 2.13; an
# older torchrun without it refuses the flag at launch instead of killing a save after 30 s). The ranks need it to agree on a stop step and let rank 0 write the checkpoint: ~12 GiB
# of drafter state at the reference shape, a minute or two on a slow shared filesystem. slurm/train.sbatch
# signals early enough for this grace (its --signal lead time); keep the two consistent.
# PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True unless the caller set it: batches change shape every
# step, and without it the caching allocator fragments over a long run until a large request fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=${PYBIN:-.venv/bin}
NPROC=${NPROC:-3}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ "${NNODES:-1}" != 1 ]; then
  rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}" --rdzv_backend=c10d
        --rdzv_endpoint="${MASTER_ADDR:?MASTER_ADDR is needed for several nodes}:${MASTER_PORT:-29500}"
        --rdzv_id="${RDZV_ID:-dflash}")
else
  rdzv=(--standalone)
fi
cmd=("$PYBIN/torchrun" "${rdzv[@]}" --nproc_per_node="$NPROC" --max-restarts="${MAX_RESTARTS:-0}"
     --shutdown-timeout="$SHUTDOWN_TIMEOUT" -m dflash_dist.train "$@")
if [ -n "${DRY_RUN:-}" ]; then
  echo "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF ${cmd[*]}"
  exit 0
fi
exec "${cmd[@]}"
