#!/usr/bin/env bash
# The GPU check (issue 21): on a machine with one CUDA GPU, in at most ~8 minutes, train the debug
# model 2 replicas x 1 rank on that GPU (bf16 params, fp32 reduce) through mpirun with a replica
# SIGKILLed mid-sync and respawned, the oracle on GPU tensors, host-staging bandwidth
# (scripts/gpu_check.py says what each part prints). Without a GPU: one skip line, exit 0.
#   bash scripts/gpu_check.sh          # on the GPU machine
#   bash scripts/gpu_check.sh --cpu    # dry run of the same plan on CPU (plumbing only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PATH="$(dirname "$PY"):$PATH"
if [ "${1:-}" != "--cpu" ]; then
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  if [ "$gpus" = "0" ]; then
    echo "gpu_check: SKIP: no CUDA GPU on this machine (torch.cuda.device_count() = 0); nothing was run"
    exit 0
  fi
fi
exec timeout 480 "$PY" scripts/gpu_check.py "$@"
