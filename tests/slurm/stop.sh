#!/usr/bin/env bash
# Stop the local Slurm lab started by start.sh: its jobs' processes, the slurmds, slurmctld,
# slurmdbd, MariaDB and munged, each by its pid file (never by process name), waiting for each to
# exit. Waits while a test session holds the lab. The lab folder stays (logs for a post-mortem);
# the next start.sh wipes it.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"

[[ -d $LAB ]] || exit 0
wait_for_sessions
exec 9>"$LAB.lock"
flock 9
stop_all
log "stopped (lab folder $LAB)"
