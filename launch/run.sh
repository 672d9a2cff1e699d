#!/usr/bin/env bash
# The one place that starts torchrun: used by demo.sh on one machine and by slurm/train.sbatch per node.
# Single node: NPROC (default 3). Multi-node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT from the caller.
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=${PYBIN:-.venv/bin}
NPROC=${NPROC:-3}
if [ -n "${NNODES:-}" ] && [ "${NNODES}" != 1 ]; then
  rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:?}" --rdzv_backend=c10d
        --rdzv_endpoint="${MASTER_ADDR:?}:${MASTER_PORT:-29500}" --rdzv_id="${RDZV_ID:-dflash}")
else
  rdzv=(--standalone)
fi
exec "$PYBIN/torchrun" "${rdzv[@]}" --nproc_per_node="$NPROC" ${MAX_RESTARTS:+--max-restarts="$MAX_RESTARTS"} \
  -m dflash_dist.train "$@"
