#!/usr/bin/env bash
# Quickstart command 1: set up, then run the main job (a CPU HSDP run through mpirun + ULFM).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/recover-hsdp train --config torchtitan_configs/debug_cpu.toml --replicas 2 \
  --out outputs/demo "$@"
