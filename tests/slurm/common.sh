# Shared by start.sh and stop.sh (sourced, not run): lab layout and pid-file helpers.
# Every daemon of the lab writes its pid file under $LAB/run (munged: $LAB/munge), and is found
# and stopped only through it, never by process name: other Slurm or MariaDB instances on the
# machine are not ours.

LAB=${OOBLECK_SLURM_LAB:-/tmp/oobleck-slurm-lab}
CONF=$LAB/slurm.conf
CLUSTER_NODES=(node1 node2 node3 node4)
SPARE_NODES=(node5 node6 node7 node8)
DB_PORT=${OOBLECK_SLURM_DB_PORT:-17306}

log() { echo "[slurm-lab] $*" >&2; }

# running PID: the process exists and is not a zombie. Zombies count as gone: here they wait
# for the container's init to reap them, which can take seconds.
running() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ -n $stat && ${stat%% *} != Z ]]
}

# pid_of PIDFILE COMM: print the pid in PIDFILE if that process is alive and its command name is
# COMM (a stale file from an earlier run may hold a pid now used by something else); else fail.
pid_of() {
    local file=$1 comm=$2 pid
    [[ -s $file ]] || return 1
    pid=$(tr -dc '0-9' <"$file")
    [[ -n $pid ]] && running "$pid" || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm" ]] || return 1
    echo "$pid"
}

# stop_pidfile PIDFILE COMM [SECONDS]: SIGTERM the process, wait, then SIGKILL; remove the file.
stop_pidfile() {
    local file=$1 comm=$2 wait_s=${3:-15} pid i
    if pid=$(pid_of "$file" "$comm"); then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < wait_s * 10; i++)); do
            running "$pid" || break
            sleep 0.1
        done
        if running "$pid"; then
            log "$comm (pid $pid) ignored SIGTERM for ${wait_s}s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                running "$pid" || break
                sleep 0.1
            done
        fi
    fi
    rm -f "$file"
}

# wait_for_sessions: before stopping a lab, wait until no test session holds it (the lock of
# tests/slurm/lab.py SlurmLab.exclusive), unless we run for that session
# (OOBLECK_SLURM_SESSION_HELD=1). Holds the lock on fd 8 until this script exits.
wait_for_sessions() {
    [[ ${OOBLECK_SLURM_SESSION_HELD:-} == 1 ]] && return 0
    exec 8>>"$LAB.session-lock"
    flock -n 8 && return 0
    log "waiting for the test session that holds the lab: $(cat "$LAB.session-lock")"
    flock -w 600 8 || { log "ERROR: the lab is still held after 600s"; exit 1; }
}

# session_busy: another test session holds the lab now (we do not, and do not wait).
session_busy() {
    [[ ${OOBLECK_SLURM_SESSION_HELD:-} == 1 ]] && return 1
    local free=0
    exec 7>>"$LAB.session-lock"
    flock -n 7 && free=1
    exec 7>&- # closing the fd releases the lock if we got it
    ((free == 0))
}

# The daemons in start order, as "PIDFILE COMM" (slurmd lines come from node names).
core_daemons() {
    echo "$LAB/munge/munged.pid munged"
    echo "$LAB/run/mariadb.pid mariadbd"
    echo "$LAB/run/slurmdbd.pid slurmdbd"
    echo "$LAB/run/slurmctld.pid slurmctld"
}
slurmd_pidfile() { echo "$LAB/run/slurmd-$1.pid"; }

# Print the logs of the lab (last lines of each), for error messages.
show_logs() {
    local f
    for f in "$LAB"/log/* "$LAB"/munge/munged.log; do
        [[ -s $f ]] || continue
        echo "----- $f (last 25 lines) -----" >&2
        tail -n 25 "$f" >&2
    done
}

# kill_job_processes: SIGKILL what runs the lab's jobs. Stepds daemonise away from their slurmd,
# so they are found by the node log file each holds open; job processes (batch scripts, tasks,
# including those that left their stepd's tree) by SLURM_CONF=$CONF and SLURM_JOB_ID in their
# environment.
kill_job_processes() {
    local p f comm
    for p in /proc/[0-9]*; do
        read -r comm 2>/dev/null <"$p/comm" || continue
        [[ $comm == slurmstepd ]] || continue
        for f in "$p"/fd/*; do
            if [[ $(readlink "$f") == "$LAB"/log/slurmd-* ]]; then
                kill -KILL "${p#/proc/}" 2>/dev/null || true
                break
            fi
        done
    done
    for f in $(grep -lzxF "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null); do
        p=${f%/environ}
        if [[ ${p#/proc/} != "$$" ]] && grep -qz '^SLURM_JOB_ID=' "$f" 2>/dev/null; then
            kill -KILL "${p#/proc/}" 2>/dev/null || true
        fi
    done
    return 0
}

# stop_orphans: SIGKILL daemons of this lab that no pid file names any more (the lab folder was
# wiped under them, or a start failed half-way and a later one rewrote the pid files): a lab
# daemon's command line names the lab folder, or (slurmdbd, which takes no arguments) its
# environment has SLURM_CONF=$CONF. Command names only narrow the search to daemons.
stop_orphans() {
    local p pid comm i killed=()
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        read -r comm 2>/dev/null <"$p/comm" || continue
        case $comm in munged | mariadbd | slurmdbd | slurmctld | slurmd) ;; *) continue ;; esac
        if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "$LAB/" ||
            grep -qzxF "SLURM_CONF=$CONF" "$p/environ" 2>/dev/null; then
            log "stopping $comm (pid $pid): a daemon of this lab without a pid file"
            kill -KILL "$pid" 2>/dev/null || true
            killed+=("$pid")
        fi
    done
    for pid in "${killed[@]}"; do
        for ((i = 0; i < 50; i++)); do
            running "$pid" || break
            sleep 0.1
        done
    done
    return 0
}

# stop_all: stop every process of the lab, slurmds and jobs first, daemons by their pid files,
# then whatever daemon of the lab no pid file names.
stop_all() {
    local f file comm
    for f in "$LAB"/run/slurmd-*.pid; do
        [[ -e $f ]] && stop_pidfile "$f" slurmd
    done
    kill_job_processes
    while read -r file comm; do
        stop_pidfile "$file" "$comm"
    done < <(core_daemons | tac)
    stop_orphans
}
