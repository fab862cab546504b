#!/usr/bin/env bash
# A throwaway Slurm cluster on this one machine, for tests/experiments/cluster/test_slurm.py (and CI): Debian's Slurm
# 22.05 (slurm-wlm) with munge, run as root, without cgroups (proctrack/linuxproc, task/none).
#
#   scripts/slurm_one_node.sh start   # install (apt) if needed, write slurm.conf, start the daemons
#   scripts/slurm_one_node.sh stop    # scontrol shutdown, then munged by the pid noted at start
#
# The machine is declared as SLURM_NODES (default 2) Slurm nodes, node1..nodeN: one slurmd each
# (`slurmd -N nodeK`, its own port), splitting the cores between them, so that one run can be
# tested across two Slurm nodes. SLURM_NODES=1 declares one node. Everything the daemons write
# lives under SLURM_DIR (default /tmp/posenc-slurm). Needs root (it writes /etc/slurm/slurm.conf).
set -euo pipefail

SLURM_DIR=${SLURM_DIR:-/tmp/posenc-slurm}
SLURM_NODES=${SLURM_NODES:-2}
CONF=/etc/slurm/slurm.conf

install() {
    if command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then return; fi
    for attempt in 1 2 3; do
        if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; then
            return
        fi
        echo "apt-get attempt $attempt failed; retrying" >&2
        sleep 10
    done
    echo "could not install slurm-wlm and munge with apt-get" >&2
    exit 1
}

write_conf() {
    local host cpus mem per_node k
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))  # half the memory, in MB
    per_node=$((cpus / SLURM_NODES))
    if [ "$per_node" -lt 1 ]; then per_node=1; fi
    mkdir -p "$SLURM_DIR"/{state,log} /etc/slurm
    {
        echo "# Written by scripts/slurm_one_node.sh: $SLURM_NODES Slurm node(s) on $host"
        echo "ClusterName=posenc"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "AuthType=auth/munge"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "StateSaveLocation=$SLURM_DIR/state"
        echo "SlurmdSpoolDir=$SLURM_DIR/spool-%n"
        echo "SlurmctldLogFile=$SLURM_DIR/log/ctld.log"
        echo "SlurmdLogFile=$SLURM_DIR/log/d-%n.log"
        echo "SlurmctldPidFile=$SLURM_DIR/ctld.pid"
        echo "SlurmdPidFile=$SLURM_DIR/d-%n.pid"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "MpiDefault=none"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "ReturnToService=2"
        echo "KillWait=5"               # scancel: SIGTERM, then SIGKILL 5 s later (default 30)
        echo "MinJobAge=600"            # finished jobs stay visible to squeue/scontrol for 10 minutes
        for k in $(seq 1 "$SLURM_NODES"); do
            echo "NodeName=node$k NodeHostname=$host NodeAddr=127.0.0.1 Port=$((17000 + k)) CPUs=$per_node RealMemory=$((mem / SLURM_NODES)) State=UNKNOWN"
        done
        echo "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    } >"$CONF"
}

start() {
    install
    write_conf
    mkdir -p /run/munge
    chown munge:munge /run/munge /etc/munge/munge.key
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        echo "munged already runs; using it" >&2
        : >"$SLURM_DIR/munged.pid"  # not ours: stop leaves it alone
    else
        /usr/sbin/munged --force
        pgrep -nx munged >"$SLURM_DIR/munged.pid"  # munged writes no pid file here: note the newest
    fi
    /usr/sbin/slurmctld
    for k in $(seq 1 "$SLURM_NODES"); do
        mkdir -p "$SLURM_DIR/spool-node$k"
        /usr/sbin/slurmd -N "node$k"
    done
    for _ in $(seq 1 60); do
        if [ "$(sinfo -h -o '%t' | sort -u)" = "idle" ]; then
            sinfo
            return
        fi
        sleep 1
    done
    echo "Slurm did not come up within 60 s; logs in $SLURM_DIR/log:" >&2
    sinfo >&2 || true
    tail -n 20 "$SLURM_DIR"/log/*.log >&2 || true
    exit 1
}

stop() {
    local pid k
    scontrol shutdown >/dev/null 2>&1 || true
    for pid_file in "$SLURM_DIR"/ctld.pid "$SLURM_DIR"/d-node*.pid; do
        [ -s "$pid_file" ] || continue
        pid=$(cat "$pid_file")
        for _ in $(seq 1 30); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then kill "$pid" || true; fi
    done
    if [ -s "$SLURM_DIR/munged.pid" ]; then
        kill "$(cat "$SLURM_DIR/munged.pid")" 2>/dev/null || true
        : >"$SLURM_DIR/munged.pid"
    fi
    for k in ctld d-node; do rm -f "$SLURM_DIR/$k"*.pid; done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *)
        echo "usage: $0 start|stop" >&2
        exit 2
        ;;
esac
