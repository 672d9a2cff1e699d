#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/system/test_slurm.py and for trying slurm/train.sbatch by hand.
#   bash launch/slurm_local.sh install     installs Debian's slurm-wlm and munge where missing (root)
#   bash launch/slurm_local.sh start DIR   munged, slurmctld and slurmd in the background, everything under DIR
#                                          (slurm.conf, state, spool, logs, pid files, munge key and socket);
#                                          then: export SLURM_CONF=DIR/slurm.conf and use sbatch/squeue/scancel
#   bash launch/slurm_local.sh stop DIR    stops the three daemons started by `start DIR`
# No systemd: the daemons run as root (slurmd must, to start jobs as their user) and are started and stopped
# here. Their own munge socket and ports keep them apart from a system Slurm or munge on the same machine.
# Settings the stop paths depend on (docs/operations.md, "Slurm"): KILL_WAIT (KillWait, s between Slurm's
# SIGTERM and SIGKILL to a cancelled or timed-out job: the save must fit in it; default 30, as Slurm's),
# PROCTRACK (which processes of a step a signal reaches; default proctrack/linuxproc: every descendant of
# the step's tasks, as proctrack/cgroup does on a production cluster, without needing a cgroup mount),
# CRED_EXPIRE (AuthInfo cred_expire: a requeued job is eligible again only after it, + 1 s; default 120, as
# Slurm's) and SCHED_INTERVAL (s between passes of the scheduler, which starts an eligible requeued job;
# default 60, as Slurm's). The tests shorten the last two. EXTRA_CONF: more slurm.conf lines (e.g. a
# preemption set-up: PreemptType, PreemptMode, partitions of this node with PriorityTier and GraceTime).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # the daemons live there; a non-login shell may not have it

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  [ "$(id -u)" = 0 ] || { echo "slurm_local.sh: slurm-wlm and munge are missing; install them as root" >&2; exit 2; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_conf() {  # DIR HOST: slurm.conf for one node named HOST with this machine's CPUs
  local dir=$1 host=$2
  cat > "$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket,cred_expire=${CRED_EXPIRE:-120}
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=${PROCTRACK:-proctrack/linuxproc}
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=${SCHED_INTERVAL:-60}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
# Jobs may be requeued (Slurm's default; sbatch --requeue asks for it per job anyway).
JobRequeue=1
KillWait=${KILL_WAIT:-30}
# Finished jobs stay visible to scontrol (no accounting database here) for 10 minutes.
MinJobAge=600
# config_overrides: the node may declare more CPUs than this machine has, so a job that asks for them
# (slurm/train.sbatch's header) still runs here.
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=${CPUS:-64} State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
${EXTRA_CONF:-}
EOF
}

start() {
  local dir host i
  dir=$(realpath -m "${1:?usage: slurm_local.sh start DIR}")
  host=$(hostname -s)
  mkdir -p "$dir"/{munge,state,spool,log}
  chmod 700 "$dir/munge"
  head -c 1024 /dev/urandom > "$dir/munge/munge.key"
  chmod 400 "$dir/munge/munge.key"
  # --force: munged refuses a key or socket below a world-writable directory such as /tmp otherwise.
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  write_conf "$dir" "$host"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -i  # -i: ignore state left by an earlier cluster in the same directory
  slurmd
  for i in $(seq 100); do  # the node registers within a few seconds
    if sinfo -h -n "$host" -o %T 2>/dev/null | grep -qx idle; then
      echo "export SLURM_CONF=$dir/slurm.conf"
      return
    fi
    sleep 0.2
  done
  echo "slurm_local.sh: node $host did not become idle; see $dir/log/" >&2
  tail -n 20 "$dir"/log/*.log >&2
  stop "$dir"
  exit 1
}

stop() {
  local dir pidfile pid i
  dir=$(realpath -m "${1:?usage: slurm_local.sh stop DIR}")
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    pid=$(cat "$pidfile" 2>/dev/null) || continue
    kill -TERM "$pid" 2>/dev/null || continue
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

case "${1:-}" in
  install) install ;;
  start) install; start "${2:-}" ;;
  stop) stop "${2:-}" ;;
  *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
