#!/usr/bin/env bash
# Quickstart command 1: set up, then run the main job: the failure demo (CPU HSDP, 4 replicas,
# replicas SIGKILLed during the gradient sync, summary printed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PATH="$PWD/.venv/bin:$PATH"   # the venv's mpirun / torchrun, as if activated
exec .venv/bin/recover-hsdp demo --config torchtitan_configs/debug_cpu.toml --replicas 4 \
  --out outputs/demo "$@"
