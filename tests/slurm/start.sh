#!/usr/bin/env bash
# Start the local multi-node Slurm lab, or reuse it when it already runs. Run as root.
#
#   eval "$(bash tests/slurm/start.sh)"      # prints: export SLURM_CONF=$LAB/slurm.conf
#                                            # and "# started in Ns" or "# reused in Ns"
#
# From nothing: installs the Debian packages if missing, adds node1..node8 to /etc/hosts, and starts
# munged, MariaDB (127.0.0.1 only), slurmdbd, slurmctld and one slurmd per virtual node node1..node4
# (node5..node8 are spares, see slurm.conf.in and lab.py), then waits until node1..node4 are idle.
# All state, pid and log files live under ${OOBLECK_SLURM_LAB:-/tmp/oobleck-slurm-lab}.
#
# Reuse: when all of munged, MariaDB, slurmdbd and slurmctld of this lab run, with the config the
# templates give now, they are kept, missing node1..node4 slurmds are started and DOWN ones resumed. Otherwise whatever is left of an earlier run is
# stopped (by its pid files) and the lab folder is wiped: a cold start always begins from empty
# Slurm and accounting state, so job ids restart at 1 (use a fresh output folder per run).
#
# Environment: OOBLECK_SLURM_LAB (lab folder), OOBLECK_SLURM_DB_PORT (MariaDB port, 17306),
# OOBLECK_SLURM_START_TIMEOUT (seconds to wait for each daemon and for the nodes, 60).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
TIMEOUT=${OOBLECK_SLURM_START_TIMEOUT:-60}
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
export SLURM_CONF=$CONF

fail() {
    log "ERROR: $*"
    show_logs
    exit 1
}

# wait_for WHAT CMD...: retry CMD (quietly) until it succeeds, or fail after $TIMEOUT seconds.
wait_for() {
    local what=$1 deadline=$((SECONDS + TIMEOUT))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || fail "$what: not ready after ${TIMEOUT}s (waiting for: $*)"
        sleep 0.2
    done
}

install_packages() {
    local missing=() p rc=0 policy=/usr/sbin/policy-rc.d added=0
    for p in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null) == installed ]] || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    log "installing ${missing[*]}"
    # The packages' own services must not start (no systemd here, and we start ours by hand):
    # policy-rc.d exit 101 is Debian's switch for that.
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } >&2 || rc=$?
    ((added)) && rm -f "$policy"
    ((rc == 0)) || fail "apt-get install ${missing[*]} failed (exit $rc)"
}

add_hosts() {
    local n missing=0
    for n in "${CLUSTER_NODES[@]}" "${SPARE_NODES[@]}"; do
        getent hosts "$n" >/dev/null || missing=1
    done
    # Append only: /etc/hosts is often a bind mount that cannot be replaced (sed -i).
    ((missing)) && echo "127.0.0.1 ${CLUSTER_NODES[*]} ${SPARE_NODES[*]}  # oobleck-slurm lab" >>/etc/hosts
    return 0
}

# launch NAME CMD...: start a daemon that forks itself into the background, detached from this
# script: its own session, stdio to $LAB/log/NAME.out, and without our lock fds 8 and 9 (a daemon
# inheriting one would hold that lock for its whole life). Fails when the daemon's start fails.
# launch_fg NAME CMD...: the same for a daemon that stays in the foreground (setsid -f forks it).
launch() {
    local name=$1 rc=0
    shift
    setsid "$@" </dev/null >>"$LAB/log/$name.out" 2>&1 8>&- 9>&- || rc=$?
    ((rc == 0)) || fail "$name did not start (exit $rc)"
}
launch_fg() {
    local name=$1
    shift
    setsid -f "$@" </dev/null >>"$LAB/log/$name.out" 2>&1 8>&- 9>&-
}

render() { # render TEMPLATE OUTPUT: fill in @LAB@ and @DB_PORT@
    sed -e "s|@LAB@|$LAB|g" -e "s|@DB_PORT@|$DB_PORT|g" "$HERE/$1" >"$2"
}

# config_current: the lab's config files are what the templates give now (else a running lab
# is restarted, so that an edited template always takes effect).
config_current() {
    local template out
    for template in slurm.conf.in gres.conf.in slurmdbd.conf.in mariadb.cnf.in; do
        out=$LAB/${template%.in}
        render "$template" "$out.new"
        cmp -s "$out" "$out.new" || { rm -f "$out.new"; return 1; }
        rm -f "$out.new"
    done
}

core_running() {
    local file comm
    while read -r file comm; do
        pid_of "$file" "$comm" >/dev/null || return 1
    done < <(core_daemons)
}

# check_ports: the lab's fixed ports are free (one lab per machine; else say who holds them).
check_ports() {
    local port
    for port in 6817 6819 $(seq 17001 17008) "$DB_PORT"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            log "ERROR: port $port on 127.0.0.1 is in use (another Slurm lab or daemon?); the lab" \
                "needs 6817 (slurmctld), 6819 (slurmdbd), 17001-17008 (slurmd), $DB_PORT (MariaDB)"
            exit 1
        fi
    done
}

cold_start() {
    [[ -n $LAB && $LAB != / ]] || fail "refusing to wipe lab folder '$LAB'"
    check_ports
    rm -rf "$LAB"
    install -d -m 0755 "$LAB" "$LAB/run" "$LAB/log" "$LAB/state" "$LAB/spool"
    install -d -m 0700 "$LAB/state/ctld"
    render slurm.conf.in "$CONF"
    render gres.conf.in "$LAB/gres.conf" # beside slurm.conf, where slurmd looks for it
    # gres.conf's placeholder GPUs: character devices, as slurmd requires ("is not a valid character
    # or block device"), twins of /dev/null (1, 3) that nothing opens.
    install -d "$LAB/dev"
    mknod -m 0666 "$LAB/dev/nvidia0" c 1 3
    mknod -m 0666 "$LAB/dev/nvidia1" c 1 3
    render slurmdbd.conf.in "$LAB/slurmdbd.conf"
    chmod 600 "$LAB/slurmdbd.conf" # slurmdbd refuses a config others can read (it holds the DB password)
    render mariadb.cnf.in "$LAB/mariadb.cnf"

    # munged runs as the munge user and checks its files: its own dir, others may only traverse it
    # (to reach the socket).
    install -d -o munge -g munge -m 0711 "$LAB/munge"
    mungekey --create --keyfile="$LAB/munge/munge.key" || fail "mungekey failed"
    chown munge:munge "$LAB/munge/munge.key"
    launch munged runuser -u munge -- /usr/sbin/munged --socket="$LAB/munge/munge.socket" \
        --key-file="$LAB/munge/munge.key" --pid-file="$LAB/munge/munged.pid" \
        --log-file="$LAB/munge/munged.log" --seed-file="$LAB/munge/munged.seed"
    wait_for munged bash -c "munge -n -S '$LAB/munge/munge.socket' | unmunge -S '$LAB/munge/munge.socket'"

    mariadb-install-db --defaults-file="$LAB/mariadb.cnf" --auth-root-authentication-method=socket \
        --skip-test-db >"$LAB/log/mariadb-install.log" 2>&1 || fail "mariadb-install-db failed"
    launch_fg mariadb mariadbd --defaults-file="$LAB/mariadb.cnf"
    wait_for MariaDB mariadb --defaults-file="$LAB/mariadb.cnf" -e "SELECT 1"
    mariadb --defaults-file="$LAB/mariadb.cnf" -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || fail "creating the slurm DB user failed"

    launch slurmdbd slurmdbd
    wait_for slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster lab >/dev/null || fail "sacctmgr add cluster failed"

    launch slurmctld slurmctld -f "$CONF"
    wait_for slurmctld bash -c "scontrol ping | grep -q UP"
}

start_nodes() {
    local node
    for node in "${CLUSTER_NODES[@]}"; do
        pid_of "$(slurmd_pidfile "$node")" slurmd >/dev/null && continue
        launch "slurmd-$node" slurmd -f "$CONF" -N "$node"
    done
}

# nodes_idle: true when node1..node4 are all idle.
nodes_idle() {
    local states
    states=$(sinfo -h -N -n "$(IFS=,; echo "${CLUSTER_NODES[*]}")" -o '%N %T' | sort -u)
    [[ $(grep -c ' idle$' <<<"$states") == "${#CLUSTER_NODES[@]}" ]]
}
# resume_down_nodes: on reuse, resume the nodes a test or an earlier run left DOWN or DRAINED
# (ReturnToService brings back only those that were DOWN for not responding).
resume_down_nodes() {
    local node state
    while read -r node state; do
        case $state in
        down | drained | draining | fail | failing) scontrol update nodename="$node" state=resume || true ;;
        esac
    done < <(sinfo -h -N -n "$(IFS=,; echo "${CLUSTER_NODES[*]}")" -o '%N %T' | tr -d '*~#!%$@^-' | sort -u)
}

main() {
    local t0=$EPOCHREALTIME mode
    [[ $(id -u) == 0 ]] || { log "ERROR: start.sh must run as root (it installs packages and runs the daemons as root)"; exit 1; }
    mkdir -p "$(dirname "$LAB")"
    exec 9>"$LAB.lock" # one start.sh/stop.sh at a time (apt-get included)
    flock 9
    install_packages
    add_hosts
    mode=started
    if core_running; then
        if config_current; then
            mode=reused
        else
            log "the config templates changed since the lab started: restarting it"
            wait_for_sessions
        fi
    fi
    if [[ $mode == started ]]; then
        stop_all
        cold_start
    elif session_busy; then
        # Its tests down and kill nodes on purpose: repairing them now would break those tests.
        # The session resets the lab when it ends.
        log "reused: a test session holds the lab ($(cat "$LAB.session-lock")); nodes left as they are"
        echo "export SLURM_CONF=$CONF"
        echo "# reused"
        return 0
    fi
    start_nodes
    [[ $mode == reused ]] && resume_down_nodes
    local deadline=$((SECONDS + TIMEOUT))
    until nodes_idle; do
        if ((SECONDS >= deadline)); then
            sinfo -N >&2 || true
            fail "nodes ${CLUSTER_NODES[*]} not all idle after ${TIMEOUT}s"
        fi
        sleep 0.2
    done
    local took
    took=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    log "$mode: ${CLUSTER_NODES[*]} idle after ${took}s; lab folder $LAB"
    echo "export SLURM_CONF=$CONF"
    echo "# $mode in ${took}s" # read by tests/conftest.py: only a session that started it stops it
}

main "$@"
