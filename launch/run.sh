#!/usr/bin/env bash
# The one place that starts torchrun: demo.sh calls it on one machine, slurm/train.sbatch once per node,
# launch/regenerate.sh (MODULE=dflash_dist.data.regenerate, from the caller's directory) for its ranks.
#   one node : NPROC ranks (default 3), --standalone rendezvous
#   N nodes  : NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID from the caller; c10d rendezvous hosted by the
#              agent on MASTER_ADDR (the first node); NODE_RANK only orders the logs (c10d assigns ranks)
# DRY_RUN=1 prints the command (with the environment it sets) instead.
#
# Exit code: the workers' own, which each writes to a temporary directory as it leaves (DFLASH_EXIT_CODE_DIR):
# 0 done, 75 stopped on request with state saved (requeue and resume), 2 bad input, 3 a peer died, 4 diverged;
# a failure code wins, then 75 (workers that had finished, 0, beside stopped ones: still a resumable stop);
# torchrun's own code only when a worker died without one (killed). torchrun alone cannot say: after a
# signal it exits 1 even when every worker saved and exited 75.
#
# Stop requests: SIGTERM, SIGUSR2 or SIGHUP to this script is passed on once, as SIGTERM, to the torchrun
# agent, which forwards it to every worker and waits SHUTDOWN_TIMEOUT for them. The agent itself ignores
# SIGUSR2 (its default action would kill it and leave its workers unsupervised), so a SIGUSR2 sent to the
# whole process tree (Slurm's --signal to a job step) reaches the workers directly and through this
# script. SIGINT is not passed on: a terminal's Ctrl-C already reaches the agent, which forwards it.
# torchrun restarts (--max-restarts) are not used: with gloo the restarted group fails to form, and a
# worker's stop (exit 75) would be taken for a failure and restarted; a crashed run is requeued by
# slurm/train.sbatch instead, or started again by hand, and resumes from its newest checkpoint.
#
# SHUTDOWN_TIMEOUT (seconds, default 300): torchrun's --shutdown-timeout, the grace between the agent's
# SIGTERM to its workers and its SIGKILL (torch's default is 30 s; the option exists in the torch this
# project installs, 2.13). The ranks need it to agree on a stop step and let rank 0 write the checkpoint:
# ~12 GiB of drafter state at the reference shape, a minute or two on a slow shared filesystem.
# slurm/train.sbatch signals early enough for this grace (its --signal lead time); keep the two consistent.
# PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True unless the caller set it: batches change shape every
# step, and without it the caching allocator fragments over a long run until a large request fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ -n "${KEEP_CWD:-}" ] || cd "$root"  # training's relative paths (configs/, runs/) are the repository's
PYBIN=${PYBIN:-$root/.venv/bin}
NPROC=${NPROC:-3}
# A positive count, checked before torchrun: it fails on 0 or -1 after run.sh has nothing to read (the exit
# was 0), and takes auto/cpu/gpu, which the exit-code loop below cannot count.
if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then
  echo "launch/run.sh: NPROC=$NPROC: must be a whole number of ranks per node >= 1" >&2
  exit 2
fi
MODULE=${MODULE:-dflash_dist.train}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
# (training only: vLLM, which regeneration runs, manages its own CUDA memory pool)
[ "$MODULE" != dflash_dist.train ] || export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ "${MAX_RESTARTS:-0}" != 0 ]; then
  echo "launch/run.sh: MAX_RESTARTS=$MAX_RESTARTS is not supported: torchrun's restarted gloo group does not" \
       "form, and a stop would be restarted; a crashed run resumes when started again (slurm/train.sbatch" \
       "requeues it)" >&2
  exit 2
fi
if [ "${NNODES:-1}" != 1 ]; then
  rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}" --rdzv_backend=c10d
        --rdzv_endpoint="${MASTER_ADDR:?MASTER_ADDR is needed for several nodes}:${MASTER_PORT:-29500}"
        --rdzv_id="${RDZV_ID:-dflash}")
else
  rdzv=(--standalone)
fi
cmd=("$PYBIN/torchrun" "${rdzv[@]}" --nproc_per_node="$NPROC" --max-restarts=0
     --shutdown-timeout="$SHUTDOWN_TIMEOUT" -m "$MODULE" "$@")
if [ -n "${DRY_RUN:-}" ]; then
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-} ${cmd[*]}"
  exit 0
fi

codes=$(mktemp -d "${TMPDIR:-/tmp}/dflash-exit.XXXXXX")
trap 'rm -rf "$codes"' EXIT
# The subshell ignores SIGUSR2 and execs torchrun, which keeps it ignored (Python leaves an ignored signal
# alone); its workers install their own handler for it as they start.
( trap '' USR2; DFLASH_EXIT_CODE_DIR=$codes exec "${cmd[@]}" ) &
agent=$!
stop_sent=
stop() {
  [ -n "$stop_sent" ] && return
  stop_sent=1
  echo "$(date +%T) launch/run.sh: $1: passing SIGTERM to torchrun (pid $agent), which stops its workers" >&2
  kill -TERM "$agent" 2>/dev/null || true
}
for sig in TERM USR2 HUP; do trap "stop SIG$sig" "$sig"; done
trap '' INT
rc=0
while true; do  # `wait` returns early when a trapped signal arrives: wait for torchrun itself
  wait "$agent" && rc=0 || rc=$?
  kill -0 "$agent" 2>/dev/null || break
done

# The run's code from the workers': the first failure code a worker wrote (2, 3, 4, 1); else, if a worker
# wrote nothing (it was killed), torchrun's own, 1 at least; else 75 if any stopped; else 0.
written=() failed= missing= stopped=
for ((r = 0; r < NPROC; r++)); do
  c=$(cat "$codes/local-rank-$r" 2>/dev/null) || c=none
  written+=("$c")
  case $c in
    none) missing=1 ;;
    75) stopped=1 ;;
    0) ;;
    *) [ -n "$failed" ] || failed=$c ;;
  esac
done
if [ -n "$failed" ]; then code=$failed
elif [ -n "$missing" ]; then code=$((rc == 0 ? 1 : rc))
elif [ -n "$stopped" ]; then code=75
else code=0
fi
echo "$(date +%T) launch/run.sh: torchrun exited $rc; local ranks' exit codes: ${written[*]} -> exit $code" >&2
exit "$code"
