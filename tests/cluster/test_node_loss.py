"""A real multi-node topology on one machine: 3-4 "nodes" (network + UTS namespaces on a private
bridge, tests/netns_cluster.py), the job launched from node 0 across all of them with a hostfile
(one rank = one replica per node), and a node lost while it trains. Each case takes ~45-60 s here.
With 4 nodes a survivor can be blocked in a send to the lost rank: it needs the detector's notice
in-band ([Note: in-band failure notices], ``heartbeat_detector_args``).

(b) a node's link cut (no RST: a pulled cable) and (c) a node's rank frozen (SIGSTOP): the
heartbeat detector declares it dead, the others finish with B every step, the cut-off side
stops itself ([Note: split brain]: the shared output folder's claim), the launcher ends mpirun and
returns 0. (a) every process of a node SIGKILLed, its PRRTE daemon included: PRRTE (v3.0.11,
``errmgr_dvm`` ``proc_errors``) aborts the whole job on a lost daemon with no option to keep it;
the test pins down that the launcher then returns promptly with a clear error and leaves nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from conftest import DEBUG_CONFIG, REPO, in_job_repairs, read_jsonl, run_cli
from netns_cluster import NetnsCluster, skip_unless_available
from recover_hsdp.collectives.processes import read_registry

pytestmark = skip_unless_available()

STEPS = 8


def _names(tag: str, salt: int) -> tuple[str, str]:
    """A namespace prefix and a /24 of our own. NETNS_TEST_PREFIX (<= 6 chars) and
    NETNS_TEST_NET ("a.b") override the defaults ("rhl<pid>", "10.231") when several people share
    a machine; NETNS_TEST_SUBNET ("a.b.c") fixes the /24 (for tests run one after another)."""
    prefix = os.environ.get("NETNS_TEST_PREFIX", f"rhl{os.getpid() % 1000}")
    net = os.environ.get("NETNS_TEST_NET", "10.231")
    subnet = os.environ.get("NETNS_TEST_SUBNET") or f"{net}.{(salt + os.getpid()) % 250}"
    return f"{prefix}{tag}"[:8], subnet


IN_JOB = ("--recover.tiers.daemon_keepalive_s", "0", "--recover.tiers.memory_snapshot_interval", "0")
"""PRRTE's own keepalive (~8 min) and no host-memory state: a cut link stays the in-job tier's
for these short runs (with the launcher's keepalive PRRTE ends the job, and with host-memory
state the launcher ends it at the emergency boundary; the relaunch tier then takes over:
tests/cluster/test_relaunch.py)."""


def _launch(cluster: NetnsCluster, out, steps=STEPS, replicas=None, extra=(), train=IN_JOB):
    """``recover-hsdp train`` run inside node 0, one replica per node (the first ``replicas``
    nodes; the others stand by)."""
    mpi = [*cluster.mpirun_args(), "--map-by", "ppr:1:node"]
    argv = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(DEBUG_CONFIG),
            "--replicas", str(replicas or cluster.n), "--out", str(out), "--end-grace", "10",
            *[f"--mpi-arg={a}" for a in mpi], *extra,
            "--", "--training.steps", str(steps), "--recover.timeouts.hang_s", "30", *train]
    log = open(out.parent / f"{out.name}.log", "w")
    proc = cluster.popen(0, argv, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                         stdout=log, stderr=log, cwd=str(REPO))
    return proc, log


def _wait_for_step(out, step, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and any(r["step"] >= step for r in read_jsonl(path)):
            return
        assert proc.poll() is None, f"job ended early: {(out.parent / f'{out.name}.log').read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def _finish(proc, out, timeout=240):
    started = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except Exception:
        proc.kill()
        raise
    return proc.returncode, time.monotonic() - started, (out.parent / f"{out.name}.log").read_text()


def _first_attempt_end(text: str, out) -> str:
    """What a failure report needs when the first attempt ended early: mpirun's last lines before
    the relaunch tier took over (the tail of the whole log is the relaunched attempt's) and that
    attempt's events and error records."""
    cut = text.find("recover-hsdp: relaunch ")
    parts = [f"\n--- the first attempt's last lines ---\n{text[max(0, cut - 6000):cut]}"
             if cut >= 0 else f"\n--- the log's last lines ---\n{text[-4000:]}"]
    first = out / "relaunch" / "attempt-0"
    for path in sorted([first / "events.jsonl", *(first / "errors").glob("*"),
                        *(out / "errors").glob("*")]):
        if path.is_file():
            parts.append(f"\n--- {path.relative_to(out)} ---\n{path.read_text()[-2000:]}")
    return "".join(parts)


def _node_of(out, replica: int) -> int:
    procs = read_registry(out)
    return int(procs[replica].host.rsplit("n", 1)[1])


@pytest.mark.parametrize("fault, nodes", [
    # CI time: test_replica_across_hosts and test_relaunch's cut link cut one (in-job tier first)
    pytest.param("link_down", 3, marks=pytest.mark.soak),
    pytest.param("frozen_rank", 3, marks=pytest.mark.soak),  # the cut link runs in CI
    # default suite time: test_real_failures' frozen 2 x 2 rank; across hosts: the cut link
    pytest.param("frozen_rank", 4, marks=pytest.mark.soak),
    pytest.param("link_down", 4, marks=pytest.mark.soak),  # default suite time; 10/10 measured
    # Open: the resumed rank's stale ob1 fragments crashed a survivor (segfault in
    # mca_pml_ob1_recv_frag_callback_frag) in 1 of 1 runs: one more replica lost (B kept).
    pytest.param("stalled_rank", 3, marks=[pytest.mark.soak, pytest.mark.xfail(
        reason="Open MPI ob1 crashes a survivor on a resumed dead rank's fragments", strict=False)])])
def test_lost_node_the_others_finish(tmp_path, fault, nodes):
    """Real process: a rank frozen / a link cut across network-namespace hosts: the detector and
    its in-band notices. ``stalled_rank``: frozen for 2 x detect_s, then resumed (a host that
    stalled): declared dead while alive, Open MPI aborts it when it runs again ("reported dead by
    someone else"); that costs its replica only, never a crash of the survivors ([Note:
    detection margins by phase])."""
    out = tmp_path / "run"
    out.mkdir()
    prefix, subnet = _names(f"{fault[0]}{nodes}", 50 + 7 * nodes + (fault == "link_down"))
    with NetnsCluster(nodes, prefix=prefix, subnet=subnet) as cluster:
        proc, log = _launch(cluster, out)
        _wait_for_step(out, 3, proc)
        victim = read_registry(out)[2]  # replica 2's rank, on node 2
        assert _node_of(out, 2) == 2
        if fault == "link_down":
            cluster.link_down(2)
        else:
            os.kill(victim.pid, signal.SIGSTOP)  # frozen, sockets open
        if fault == "stalled_rank":
            time.sleep(8.0)                       # declared dead by now (detect_s 4)
            os.kill(victim.pid, signal.SIGCONT)
        rc, wall, text = _finish(proc, out)
        log.close()
        assert rc == 0, text[-4000:]
        assert "Segmentation fault" not in text, text[-4000:]
        steps = read_jsonl(out / "metrics.jsonl")
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), text[-3000:]
        assert all(s["reduced_microbatches"] == nodes for s in steps)
        assert steps[-1]["alive_replicas"] == nodes - 1
        events = in_job_repairs(read_jsonl(out / "events.jsonl"))
        assert [e["dead_replicas"] for e in events] == [[2]], events
        assert events[0]["detect_s"] < 20, events
        summary = json.loads((out / "summary.json").read_text())
        assert summary["completed"] and summary["alive_replicas"] == nodes - 1
        ledger = read_jsonl(out / "ledger.jsonl")
        assert [line["step"] for line in ledger] == list(range(STEPS))
        # nothing of the job left on the nodes that are still reachable, and the lost node's
        # rank is gone too (it stopped itself, or it was ended with mpirun)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = {n: p for n, p in cluster.leftover_pids().items() if not n.endswith("n2")}
            if not left and victim.state() in (None, "Z"):
                break
            time.sleep(0.5)
        assert not left, left
        if fault != "link_down":
            assert victim.state() in (None, "Z")


@pytest.mark.slow  # default suite: tests/cluster/test_relaunch.py relaunches after the same fault
def test_crashed_node_with_its_daemon_ends_the_job_cleanly(tmp_path):
    """(a) SIGKILL of everything on node 2, its prted included: PRRTE aborts the job (measured:
    no PRRTE option keeps a job whose daemon is lost). With the relaunch tier off
    (``recover.tiers.max_relaunches = 0``) the launcher returns promptly, says so in one line, and no
    process of the job is left on any node.
    Real process: PRRTE's reaction to a lost daemon, and nothing left behind on the reachable
    nodes."""
    out = tmp_path / "run"
    out.mkdir()
    prefix, subnet = _names("a", 150)
    with NetnsCluster(4, prefix=prefix, subnet=subnet) as cluster:
        proc, log = _launch(cluster, out, train=("--recover.tiers.max_relaunches", "0"))
        _wait_for_step(out, 2, proc)
        cluster.kill_node(2)
        rc, wall, text = _finish(proc, out, timeout=120)
        log.close()
        assert rc != 0
        assert "recover-hsdp: error" in text
        assert wall < 60, wall
        deadline = time.monotonic() + 20
        while cluster.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cluster.leftover_pids() == {}


# Soak, not CI: CI's run of 0b483b5 lost it once (mpirun returned at step 10 while the newcomer
# started on node 2, rank 0 still alive, no PRRTE daemon message; the relaunch tier then ran the
# job on nodes 0 and 2 and the join found no replica missing). Not reproduced here in 8 runs
# (2 alone, 6 beside 2-4 busy processes; a newcomer SIGKILLed as it started only gave its join
# up, the job went on); the failure report now carries the first attempt's end. The join
# protocol is proven in process (tests/manager/test_rejoin_protocol.py) and for real on one host
# in the default suite (tests/jobs/test_rejoin.py::test_respawn_4x1).
@pytest.mark.soak
def test_replacement_joins_on_a_standby_host(tmp_path):
    """Issue 13 on a cluster: a job of 2 replicas on nodes 0 and 1 of a 3-node allocation (node 2
    stands by, in the hostfile); replica 1 is SIGKILLed at step 3; an operator on node 2 runs
    ``recover-hsdp join --out DIR --host <node 2>``; the replacement starts there, receives the
    state from replica 0 and the run ends with 2 replicas, B every step, the loss of the
    failure-free run. (A host outside the allocation cannot be added on this stack: PRRTE's
    add-host ended the whole job, measured; docs/DESIGN.md.)
    Real process: PRRTE spawning a newcomer on a standby host of the allocation."""
    steps_total = 24
    reference = tmp_path / "reference"
    ref = run_cli(["train", "--config", str(DEBUG_CONFIG), "--replicas", "2", "--out",
                   str(reference), "--", "--training.steps", str(steps_total)], timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    out.mkdir()
    prefix, subnet = _names("j", 190)
    with NetnsCluster(3, prefix=prefix, subnet=subnet) as cluster:
        # Paced, so the run outlasts the newcomer's start-up on any machine: replica 0 sleeps 1 s
        # before each forward from step 4 on (>= 40 s of steps left, CPU free for the newcomer's
        # imports); the loss is the failure-free one (a sleep changes no number).
        proc, log = _launch(cluster, out, steps=steps_total, replicas=2,
                            extra=["--fault", "replica=1,step=3,phase=grad_sync",
                                   "--fault", "replica=0,step=4,phase=forward,mode=slow,seconds=1"])
        _wait_for_step(out, 4, proc)
        join = cluster.run(2, [sys.executable, "-m", "recover_hsdp.cli.launch", "join", "--out",
                               str(out), "--host", cluster.addrs[2], "--timeout", "200"],
                           timeout=240, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                           cwd=str(REPO))
        rc, wall, text = _finish(proc, out)
        log.close()
        said = "\n".join(line for line in text.splitlines()   # the launcher's own lines
                         if line.startswith(("recover-hsdp", "[recover-hsdp fault]")))
        assert join.returncode == 0, join.stdout + join.stderr + said + _first_attempt_end(text, out)
        assert rc == 0, text[-4000:]
        steps = read_jsonl(out / "metrics.jsonl")
        assert [s["step"] for s in steps] == list(range(1, steps_total + 1))
        assert all(s["reduced_microbatches"] == 2 for s in steps)       # B, measured
        diffs = [abs(a["loss"] - b["loss"])
                 for a, b in zip(steps, read_jsonl(reference / "metrics.jsonl"))]
        assert max(diffs) <= 1e-3, diffs
        events = read_jsonl(out / "events.jsonl")
        joins = [e for e in events if e.get("phase") == "join"]
        assert [j["joined_replicas"] for j in joins if j["ok"]] == [[1]], events
        assert steps[-1]["alive_replicas"] == 2
        hosts = [p.host for p in read_registry(out)]
        assert any(h.endswith("n2") for h in hosts), hosts   # the replacement ran on node 2
        deadline = time.monotonic() + 30
        while cluster.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cluster.leftover_pids() == {}
