#!/usr/bin/env bash
# The slow and Slurm tests on a busy machine: two busy loops hog the cores for the whole run, as other
# jobs do on a CI runner or a login node. Usage: bash tests/stress.sh [pytest args...]
# (after tests/run_all.sh has installed everything once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
hogs=()
for _ in 1 2; do
  "$PY" -c 'while True: pass' &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
bash tests/slurm/start.sh
"$PY" -m pytest -q -p no:cacheprovider -m "slow or slurm" "$@"
