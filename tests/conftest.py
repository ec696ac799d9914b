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
PIPELINE_CONFIG = REPO / "torchtitan_configs" / "debug_cpu_pp.toml"  # 2 stages per replica
CACHE = REPO / "outputs" / "cache" / "local_corpus"


def run_cli(args: list[str], timeout: float = 240, env: dict | None = None,
            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``recover-hsdp`` (as ``python -m recover_hsdp.cli.launch``) with a hard timeout."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "recover_hsdp.cli.launch", *args], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def train_job(out: Path, config: Path, replicas: int, ranks: int, steps: int, *,
              stock: bool = False, faults=(), extra=(), timeout: float = 400) -> Path:
    """``recover-hsdp train`` of ``config`` into ``out`` (``--stock``: TorchTitan's own
    trainer), asserted to exit 0; its stdout kept as ``out/stdout.log``. Returns ``out``."""
    args = ["train", "--config", str(config), "--replicas", str(replicas),
            "--ranks-per-replica", str(ranks), "--out", str(out), *(["--stock"] if stock else [])]
    for fault in faults:
        args += ["--fault", fault]
    result = run_cli(args + ["--", "--training.steps", str(steps), *extra], timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    (out / "stdout.log").write_text(result.stdout)
    return out


def assert_matches_stock(mpi: Path, stock: Path, steps: int, *, reduced: int, g: int,
                         tokens: int) -> dict:
    """A ReCoVer run's folder ``mpi`` against its stock twin's ``stock`` (same config, data,
    seed): every step, per-step loss within 1e-4, it trained, ``reduced`` microbatches measured
    with ``g`` per replica, ``tokens`` per step on both, final parameters allclose. Returns the
    ReCoVer run's final parameters."""
    import torch

    mpi_steps, stock_steps = read_jsonl(mpi / "metrics.jsonl"), read_jsonl(stock / "metrics.jsonl")
    assert [s["step"] for s in mpi_steps] == list(range(1, steps + 1)) \
        == [s["step"] for s in stock_steps]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(mpi_steps, stock_steps)]
    assert max(diffs) <= 1e-4, diffs
    assert abs(mpi_steps[0]["loss"] - mpi_steps[-1]["loss"]) > 1e-3  # it trained
    for a, b in zip(mpi_steps, stock_steps):
        assert a["reduced_microbatches"] == reduced and a["g"] == g, a
        assert a["tokens"] == b["tokens"] == tokens, (a, b)
    mpi_params, stock_params = (torch.load(d / "final_params.pt") for d in (mpi, stock))
    assert mpi_params.keys() == stock_params.keys()
    for name in mpi_params:
        torch.testing.assert_close(mpi_params[name], stock_params[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return mpi_params


def no_step_waited_for_a_deadline(steps: list[dict], hang_timeout_s: float = 20.0) -> None:
    """"It did not hang", free of the machine's speed: no committed step reached the MPI call
    deadline of the run's ``hang_timeout_s`` (2H + 30 s, [Note: the timer table] in
    groups/timeouts.py), the bound a stuck wait would run into first; a run that never ends
    is the test's subprocess timeout."""
    call_s = 2 * hang_timeout_s + 30
    longest = max(s["step_time_s"] for s in steps)
    assert longest < call_s, f"a step took {longest:.1f} s >= the call deadline {call_s} s"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def in_job_repairs(events: list[dict]) -> list[dict]:
    """The in-job repair events of a run's events.jsonl. A relaunch before any step committed
    (the relaunch tier absorbing a start-up crash: seen under load, an MPI_Init abort after
    the detector's false notice) may precede them; a relaunch after training began may not."""
    relaunches = [e for e in events if e.get("phase") == "relaunch"]
    assert all(r["last_step"] == 0 for r in relaunches), relaunches
    return [e for e in events if "dead_replicas" in e]


@pytest.fixture(scope="session")
def local_corpus() -> Path:
    """Build the local corpus + tokenizer once per test session (shared cache dir)."""
    from recover_hsdp.titan.data import ensure_local_corpus

    return ensure_local_corpus(CACHE)


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory, local_corpus) -> dict[str, list[dict]]:
    """Failure-free 4 x 1 debug run (10 steps, hang_timeout 10, exact mode): the reference
    trajectory of the end-to-end and real-failure tests (stream mode is checked on its data:
    tests/titan/test_datasets.py)."""
    out = tmp_path_factory.mktemp("ref")
    runs = {}
    for mode in ("exact",):
        result = run_cli(["train", "--config", str(DEBUG_CONFIG), "--replicas", "4", "--out",
                          str(out / mode), "--", "--recover.timeouts.hang_s", "10",
                          "--recover.workload.data_assignment", mode], timeout=300)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
        runs[mode] = read_jsonl(out / mode / "metrics.jsonl")
    return runs
