#!/usr/bin/env bash
# The one place that starts torchrun: demo.sh calls it on one machine, slurm/train.sbatch once per node.
#   one node : NPROC ranks (default 3), --standalone rendezvous
#   N nodes  : NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID from the caller; c10d rendezvous hosted by the
#              agent on MASTER_ADDR (the first node); NODE_RANK only orders the logs (c10d assigns ranks)
# MAX_RESTARTS: torchrun restarts the whole group after a failure; train.resume=auto picks up the
# newest checkpoint by itself. DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=${PYBIN:-.venv/bin}
NPROC=${NPROC:-3}
if [ "${NNODES:-1}" != 1 ]; then
  rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}" --rdzv_backend=c10d
        --rdzv_endpoint="${MASTER_ADDR:?MASTER_ADDR is needed for several nodes}:${MASTER_PORT:-29500}"
        --rdzv_id="${RDZV_ID:-dflash}")
else
  rdzv=(--standalone)
fi
cmd=("$PYBIN/torchrun" "${rdzv[@]}" --nproc_per_node="$NPROC" --max-restarts="${MAX_RESTARTS:-0}"
     -m dflash_dist.train "$@")
if [ -n "${DRY_RUN:-}" ]; then
  echo "${cmd[*]}"
  exit 0
fi
exec "${cmd[@]}"
