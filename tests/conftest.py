"""Shared helpers: launch real jobs (mpirun / torchrun) through the project's CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = REPO / "torchtitan_configs" / "debug_cpu.toml"
CACHE = REPO / "outputs" / "cache" / "local_corpus"


def run_cli(args: list[str], timeout: float = 240, env: dict | None = None,
            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``recover-hsdp`` (as ``python -m recover_hsdp.cli.launch``) with a hard timeout."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "recover_hsdp.cli.launch", *args], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def local_corpus() -> Path:
    """Build the local corpus + tokenizer once per test session (shared cache dir)."""
    from recover_hsdp.titan.data import ensure_local_corpus

    return ensure_local_corpus(CACHE)
