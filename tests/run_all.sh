#!/usr/bin/env bash
# Install everything from nothing and run the whole test suite, the local Slurm cluster included.
# Usage: bash tests/run_all.sh [pytest args...]     (as root on Debian 12, Python >= 3.10)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first: 2.13.0 is the CPU build; a bare `torch` requirement would pull GBs of CUDA wheels.
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet -e '.[test,dev,hf,tensorboard,data,wandb]'

# Lint and import order, then types (configs in pyproject.toml): a finding fails the run before any test.
"$PY" -m ruff check oobleck_slurm tests benchmarks
"$PY" -m mypy

# tmux: the dashboard's terminal test drives the real command in it.
if ! command -v tmux >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tmux) >/dev/null
fi

# The Slurm tests start the local cluster themselves (tests/slurm/start.sh installs Debian's Slurm,
# munge and MariaDB if missing); starting it here first keeps its install time out of test timeouts.
bash tests/slurm/start.sh

# Three pytest-xdist workers on two cores: the suite waits on real jobs' processes (their starts,
# their steps' collectives), and a third session fills the cores' idle moments (back to back on this
# 2-core machine: 621.8 s with 3, 705.1 s with 2); the Slurm lab's tests all run in one of them
# (tests/conftest.py).
exec "$PY" -m pytest -q -p no:cacheprovider -n 3 --dist loadgroup "$@"
