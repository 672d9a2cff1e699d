#!/usr/bin/env bash
# The body both batch scripts share (slurm/train.sbatch, slurm/regenerate.sbatch source it after finding the
# repository): ranks per node, the rendezvous, one srun of the stage's launch script per node, the stop
# signals and when the job is requeued. The caller sets:
#   STAGE          what the log lines call the step (training, regeneration)
#   LAUNCH         the launch script every node runs (launch/run.sh, launch/regenerate.sh), an absolute path
#   SIGNAL_LEAD_S  the lead time of the caller's #SBATCH --signal (sbatch cannot read variables)
#   SHUTDOWN_TIMEOUT  torchrun's grace after a stop, exported
: "${STAGE:?}" "${LAUNCH:?}" "${SIGNAL_LEAD_S:?}" "${SHUTDOWN_TIMEOUT:?}"

# Ranks per node: NPROC when set, else one per allocated GPU. Without GPUs NPROC is required.
export NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-}}
if [ -z "$NPROC" ]; then
  echo "slurm: no GPUs in this allocation (SLURM_GPUS_ON_NODE is unset): set NPROC, the ranks per node" >&2
  exit 2
fi
# Rendezvous: the first node of the allocation hosts the c10d store.
# (No `| head -n 1`: under pipefail, scontrol's SIGPIPE from an early-closing head fails the script.)
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${hosts%%$'\n'*}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export NNODES=$SLURM_NNODES
export RDZV_ID=$SLURM_JOB_ID
# A crashed run (exit 1 or 3, or a killed rank) is requeued by this script up to MAX_FAILURES times in all
# (counted in the job's Comment, which a requeue keeps); torchrun restarts are not used (launch/run.sh).
MAX_FAILURES=${MAX_FAILURES:-2}

# Stop and save before the time limit. Slurm sends --signal's USR2 to every process of the step, between
# SIGNAL_LEAD_S and SIGNAL_LEAD_S + 60 s before the limit: the workers take it as a stop request, and each
# node's launch script passes it to its torchrun agent as SIGTERM, so the agent waits SHUTDOWN_TIMEOUT for
# its workers (torchrun --shutdown-timeout) while they save (training: the ranks agree on a stop step and
# rank 0 writes the checkpoint, ~12 GiB at the reference shape; regeneration: each rank writes the chunk
# in hand). They exit 75 and this script requeues the job. The lead time must exceed the grace period,
# with a minute left for the exit and the requeue.
if [ $((SHUTDOWN_TIMEOUT + 60)) -gt "$SIGNAL_LEAD_S" ]; then
  echo "warning: SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT}s leaves under 60 s of the ${SIGNAL_LEAD_S}s --signal lead time;" \
       "the time limit may kill the checkpoint save (raise --signal's lead time with it)" >&2
fi
# Long online runs see a new batch shape every step: expandable segments keep the caching allocator from
# fragmenting (launch/run.sh sets the same default; a value set by the user is kept).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# NCCL and network (adjust to the cluster):
#   NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME  the interface the nodes reach each other on (e.g. ib0, eth0);
#                                            gloo carries the plan broadcast and the stop votes
#   NCCL_IB_HCA, NCCL_IB_GID_INDEX           InfiniBand/RoCE adapters, where the defaults pick wrong
#   NCCL_DEBUG=WARN                          INFO once to check which transport NCCL picked
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1        abort a collective on a dead peer instead of hanging
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

log() { echo "$(date +%T) slurm: $*"; }
# SIGTERM to this script: Slurm is ending the job (scancel, the time limit, a preemption, or our own
# requeue below). Slurm sends it to the step too; the ranks save within KillWait (or the
# partition's GraceTime) and the job ends CANCELLED, TIMEOUT or, on a preemption, is requeued by Slurm.
# This script then requeues nothing. Nothing is forwarded: srun turns a SIGTERM of its own into SIGKILL.
ending=0 requeueing=0
on_term() {
  ending=1
  [ "$requeueing" = 1 ] || log "SIGTERM: Slurm is ending the job; the ranks save what KillWait allows; no requeue"
}
# USR2 to this script alone (scancel --signal=USR2 --batch): the same stop as --signal's, sent to the step.
on_usr2() {
  log "SIGUSR2 to the batch script: sending it to the $STAGE step"
  scancel --signal=USR2 "$SLURM_JOB_ID" || true
}
trap on_term TERM
trap on_usr2 USR2

failures=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/.*Comment=dflash-failures=\([0-9]*\).*/\1/p')
failures=${failures:-0}
log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}, failures so far $failures): $NNODES node(s) x $NPROC ranks"
# --kill-on-bad-exit=0: a node whose ranks stopped and exited 75 must not kill the others before rank 0
# has saved; a dead rank is found by the ranks' own heartbeats (exit 3 on every other rank).
srun --kill-on-bad-exit=0 --ntasks-per-node=1 \
  bash -c 'NODE_RANK=$SLURM_NODEID exec bash "$0" "$@"' "$LAUNCH" "$@" &
srun_pid=$!
rc=0
while true; do  # `wait` returns early when a trapped signal arrives: keep waiting for the step itself
  wait "$srun_pid" && rc=0 || rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done

requeue() {
  requeueing=1
  log "$1; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
}
if [ "$ending" = 1 ]; then
  log "$STAGE step exited $rc while Slurm ends the job"
elif [ "$rc" = 0 ]; then
  log "$STAGE done"
elif [ "$rc" = 75 ]; then
  requeue "$STAGE stopped with its state saved (exit 75)"
elif [ "$rc" = 2 ] || [ "$rc" = 4 ]; then
  log "$STAGE failed with exit $rc ($([ "$rc" = 2 ] && echo "bad input" || echo "diverged")): not requeued"
elif [ "$failures" -lt "$MAX_FAILURES" ]; then
  scontrol update JobId="$SLURM_JOB_ID" Comment="dflash-failures=$((failures + 1))" || true
  requeue "$STAGE failed with exit $rc (failure $((failures + 1)) of at most $MAX_FAILURES requeued)"
else
  log "$STAGE failed with exit $rc; $failures failures already requeued (MAX_FAILURES=$MAX_FAILURES): giving up"
fi
exit "$rc"
