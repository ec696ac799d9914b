"""The package layout keeps its layers: the import-linter contracts in pyproject.toml hold, the
light modules stay light (reading the config or planning a step never initialises MPI or torch),
``ruff check`` is clean and no function of the package is longer than a screen."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_ruff_is_clean():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--no-cache", "recover_hsdp", "tests", "benchmarks",
                             "scripts"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


MAX_FUNCTION_LINES = 60


def test_no_function_longer_than_a_screen():
    long = []
    for path in sorted((ROOT / "recover_hsdp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
