"""The package layout keeps its layers: the import-linter contracts in pyproject.toml hold, and the
light modules stay light (reading the config or planning a step never initialises MPI or torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    linter = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    return set(out.split())


def test_config_and_policy_import_neither_mpi_nor_torch():
    for module in ("recover_hsdp.config", "recover_hsdp.workload", "recover_hsdp.faults",
                   "recover_hsdp.collectives.mpirun"):
        loaded = _modules_after_import(module)
        assert "mpi4py.MPI" not in loaded, module
        assert "torch" not in loaded, module
        assert "torchtitan" not in loaded, module
