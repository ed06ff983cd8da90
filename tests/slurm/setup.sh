#!/usr/bin/env bash
# A real single-node SLURM cluster for the tests (Debian 12: slurmctld, slurmd, slurm-client, munge), run as
# root without systemd. Usage:
#   tests/slurm/setup.sh start [STATE_DIR]   install (apt-get) if needed, write slurm.conf, start the daemons
#   tests/slurm/setup.sh stop  [STATE_DIR]   stop the daemons it started, by the PIDs it recorded
# Clients find the cluster through SLURM_CONF=$STATE_DIR/slurm.conf (the system's /etc/slurm is untouched).
# A requeued job may start again only cred_expire + 1 s after its requeue: 121 s by default, 11 s here.
# Exit 3 (and a line on stderr) when the packages cannot be installed: the caller skips with that reason.
set -euo pipefail
cmd=${1:-start}
state=${2:-/tmp/trmoe-slurm}
mkdir -p "$state"

stop() {  # all three told at once, then waited for (each takes 1-2 s to end)
  local pids=() pid
  for name in slurmd slurmctld munged; do
    if [ -f "$state/$name.pid" ]; then
      pid=$(cat "$state/$name.pid")
      kill "$pid" 2>/dev/null && pids+=("$pid")
      rm -f "$state/$name.pid"
    fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup.sh: SLURM is not installed and cannot be (needs root and apt-get)" >&2; exit 3
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge; } \
      >"$state/apt.log" 2>&1; then
    echo "setup.sh: apt-get install slurmctld slurmd slurm-client munge failed (see $state/apt.log)" >&2; exit 3
  fi
fi
[ "$(id -u)" = 0 ] || { echo "setup.sh: the daemons must be started as root" >&2; exit 3; }

stop  # a previous run's daemons
host=$(hostname -s)
node=$(slurmd -C | head -1)                       # NodeName=<host> CPUs=... RealMemory=...
cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$node")
mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
mkdir -p "$state/spool/ctld" "$state/spool/d" "$state/log"
cat >"$state/slurm.conf" <<CONF
ClusterName=trmoe-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=3600
CommunicationParameters=NoInAddrAny
StateSaveLocation=$state/spool/ctld
SlurmdSpoolDir=$state/spool/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$((mem / 2)) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF=$state/slurm.conf

# munge: its key comes with the package (created by its postinst); munged runs as user munge
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
[ -f /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; chown munge:munge /etc/munge/munge.key; }
runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/trmoe-munged.pid
cp /run/munge/trmoe-munged.pid "$state/munged.pid"
/usr/sbin/slurmctld -f "$state/slurm.conf"
/usr/sbin/slurmd -f "$state/slurm.conf"
for _ in $(seq 100); do
  [ -f "$state/slurmctld.pid" ] && [ -f "$state/slurmd.pid" ] && sinfo -h -o %T 2>/dev/null | grep -q idle && break
  sleep 0.2
done
if ! sinfo -h -o %T | grep -q idle; then
  echo "setup.sh: the node did not come up (see $state/log/)" >&2; sinfo >&2 || true; stop; exit 1
fi
echo "SLURM_CONF=$state/slurm.conf"
