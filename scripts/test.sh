#!/usr/bin/env bash
# Quickstart command 2: set up, then run the test suite (slow tests excluded; see benchmarks/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PATH="$PWD/.venv/bin:$PATH"   # the venv's mpirun / torchrun, as if activated
exec .venv/bin/python -m pytest "$@"
