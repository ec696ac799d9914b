#!/usr/bin/env bash
# The GPU check (issue 21): on a machine with one CUDA GPU, in at most ~8 minutes, train the debug
# model 2 replicas x 1 rank on that GPU (bf16 params, fp32 reduce) through mpirun with a replica
# SIGKILLed mid-sync and respawned, the oracle on GPU tensors, host-staging bandwidth
# (scripts/gpu_check.py says what each part prints). Without an NVIDIA GPU (nvidia-smi lists
# none): one skip line, exit 0; a GPU this Python's torch cannot use: FAIL, exit 1.
#   bash scripts/gpu_check.sh          # on the GPU machine
#   bash scripts/gpu_check.sh --cpu    # dry run of the same plan on CPU (plumbing only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PATH="$(dirname "$PY"):$PATH"
if [ "${1:-}" != "--cpu" ]; then
  # SKIP only where the machine has no NVIDIA GPU at all (the driver's own list, not an import);
  # a GPU that this Python's torch cannot use is a FAIL, never a skip
  if ! listed=$(nvidia-smi -L 2>/dev/null) || ! grep -q '^GPU ' <<<"$listed"; then
    echo "gpu_check: SKIP: no NVIDIA GPU on this machine (nvidia-smi -L lists none); nothing was run"
    exit 0
  fi
  if ! gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else "0 (torch.version.cuda=%s)" % torch.version.cuda)' 2>&1 | tail -1); then
    echo "gpu_check: FAIL: nvidia-smi lists $(grep -c '^GPU ' <<<"$listed") GPU(s) but $PY cannot import torch: $gpus"
    exit 1
  fi
  if [ "${gpus%% *}" = "0" ]; then
    echo "gpu_check: FAIL: nvidia-smi lists $(grep -c '^GPU ' <<<"$listed") GPU(s) but torch in $PY sees $gpus CUDA devices"
    exit 1
  fi
fi
exec timeout 480 "$PY" scripts/gpu_check.py "$@"
