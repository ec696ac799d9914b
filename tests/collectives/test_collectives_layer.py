"""recover_hsdp.collectives without failures, at 1, 2 and 4 ranks (real ULFM mpirun jobs), plus the
MPI-free parts (Deadlines, the mpirun line). The MPI tests live in mpi_programs/layer_suite.py as
communicator-agnostic unittest mixins; this file launches that suite and checks every rank's report.
"""

import os
import subprocess
import sys

import pytest

from mpi_programs.mpijob import run_mpi
from recover_hsdp.collectives.guard import Deadlines
from recover_hsdp.collectives.mpirun import check_ulfm_mpirun, heartbeat_detector_args, mpirun_prefix


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_layer_suite(nprocs, tmp_path):
    job = run_mpi(nprocs, "layer_suite.py", [str(tmp_path)], tmp_path, timeout_s=100)
    assert job.rc == 0, job.output[-3000:]
    results = job.results()
    assert sorted(results) == list(range(nprocs)), job.output[-3000:]
    for rank, res in results.items():
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"
        assert res["ran"] >= 20


def test_deadlines_validation():
    Deadlines()  # the cluster defaults are consistent
    Deadlines.for_tests()
    with pytest.raises(ValueError, match="call_s"):
        Deadlines(call_s=10, hang_timeout_s=20)
    with pytest.raises(ValueError, match="repair_s"):
        Deadlines(repair_s=10, hang_timeout_s=20)
    with pytest.raises(ValueError, match="hang_timeout_s"):
        Deadlines(hang_timeout_s=0)
    with pytest.raises(ValueError, match="max_repair_rounds"):
        Deadlines(max_repair_rounds=0)
    assert Deadlines(hang_timeout_s=None, call_s=1, repair_s=1).effective_poll_s == pytest.approx(0.1)


def test_mpirun_prefix_and_check():
    args = mpirun_prefix(6, env={"FOO": "1"}, extra=heartbeat_detector_args())
    assert os.path.basename(args[0]) == "mpirun" and args[1:3] == ["--with-ft", "ulfm"]
    joined = " ".join(args)
    for flag in ("--mca pml ob1", "--mca btl tcp,self",
                 "--mca btl_tcp_flags send,inplace,need-ack,need-csum", "-x OMP_NUM_THREADS=1",
                 "-x FOO=1", "--mca mpi_ft_detector true", "--oversubscribe",
                 "--mca mpi_ft_propagator_with_rbcast true"):
        assert flag in joined
    assert args[-2:] == ["-np", "6"]
    assert check_ulfm_mpirun().startswith("5.")
    with pytest.raises(RuntimeError, match="not found"):
        check_ulfm_mpirun("no-such-mpirun-here")
    with pytest.raises(RuntimeError, match="not Open MPI"):
        check_ulfm_mpirun(sys.executable)  # prints "Python 3.x" for --version


def test_guard_does_not_need_mpi():
    # the deadline/watchdog module must stay importable without MPI (used by the launcher side too)
    code = "import sys, recover_hsdp.collectives.guard; assert 'mpi4py' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
