"""The stock baseline across hosts: ``recover-hsdp train --stock --hostfile`` on 2 namespace nodes
(tests/netns_cluster.py) trains like the MPI path on the same 2 nodes (per-step loss within 1e-4,
final parameters allclose, as tests/jobs/test_equivalence.py checks on one host).
Only a real process proves: the launcher's MASTER_ADDR and mpirun's placement let stock
TorchTitan's ranks on two hosts find each other and train."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import DEBUG_CONFIG, REPO, read_jsonl
from netns_cluster import NetnsCluster, skip_unless_available

pytestmark = skip_unless_available()  # ~50 s here

G, LBS, STEPS = 2, 2, 5


def _train(cluster: NetnsCluster, out, stock: bool):
    mpi = [*cluster.mpirun_args()[2:], "--map-by", "ppr:1:node"]  # --hostfile: the launcher's
    assert cluster.mpirun_args()[0] == "--hostfile"
    argv = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config",
            str(DEBUG_CONFIG), "--replicas", "2", "--ranks-per-replica", "1", "--out", str(out),
            "--gpus-per-node", "0", "--hostfile", str(cluster.hostfile),
            *[f"--mpi-arg={a}" for a in mpi], *(["--stock"] if stock else []),
            "--", "--training.steps", str(STEPS), "--recover.debug.save_final_params",
            "--training.global_batch_size", str(G * 2 * LBS)]
    result = cluster.run(0, argv, timeout=240, cwd=str(REPO),
                         env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                              "GLOO_SOCKET_IFNAME": "eth0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.soak  # CI time: the stock baseline on one host is test_equivalence's
def test_stock_baseline_across_two_hosts_matches_the_mpi_path(tmp_path, local_corpus):
    with NetnsCluster(2, prefix="rh21b", subnet="10.231.22") as cluster:
        stock_run = _train(cluster, tmp_path / "stock", stock=True)
        _train(cluster, tmp_path / "mpi", stock=False)
    assert "MASTER_ADDR=10.231.22.1" in stock_run.stdout  # the first host's address
    assert "torchrun" not in stock_run.stdout.splitlines()[0]
    mpi, stock = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("mpi", "stock"))
    assert [s["step"] for s in mpi] == list(range(1, STEPS + 1)) == [s["step"] for s in stock]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(mpi, stock)]
    assert max(diffs) <= 1e-4, diffs
    assert abs(mpi[0]["loss"] - mpi[-1]["loss"]) > 1e-3
    mpi_params, stock_params = (torch.load(tmp_path / n / "final_params.pt") for n in ("mpi", "stock"))
    assert mpi_params.keys() == stock_params.keys()
    for name in mpi_params:
        torch.testing.assert_close(mpi_params[name], stock_params[name], rtol=1e-5, atol=1e-6)
