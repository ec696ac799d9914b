"""The relaunch tier's decisions ([Note: the relaunch tier], recover_hsdp/cli/relaunch.py) and
its driver (cli/attempts.py) in-process: fake attempts instead of mpirun, fake hosts instead
of the agent. The real jobs are in tests/cluster/test_relaunch.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from recover_hsdp import certificates, host_files
from recover_hsdp.cli import attempts, relaunch
from recover_hsdp.cli import hosts as remote
from recover_hsdp.cli.hostfile import HostEntry, parse_hostfile
from recover_hsdp.cli.hosts import ssh_agent
from recover_hsdp.faults import FaultSpec
from recover_hsdp.cli.relaunch import (Evidence, daemon_hosts, ends_the_same_way, lost_hosts,
                                       merge_steps, newest_restart_point, plan_relaunch,
                                       ranks_per_host_of)



def certify(folder: Path, step: int, restart_point: bool = True) -> None:
    """What a job's writer leaves in an agreed, certified save ([Note: certified checkpoints])."""
    certificates.write(folder, certificates.Certificate(step=step, restart_point=restart_point,
                                                        state_fingerprint="0" * 16))


LOST_DAEMON = """--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-rh22bn0-2744@0,0] on node rh22bn0
  Remote daemon: [prterun-rh22bn0-2744@0,2] on node rh22bn2

This is usually due to either a failure of the TCP network
"""
FAILED_DAEMON = """A daemon failed to report back after being spawned. ...
  Local host:    rh22bn0
  Remote host:   rh22bn2
  Daemon exit status: 0
"""
HOSTS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
ALIASES = {h: f"n{i}" for i, h in enumerate(HOSTS)}


def test_hostfile_checkpoints_and_prrte_messages(tmp_path):
    entries = parse_hostfile("# cluster\nnodeA slots=4\n\nnodeB  # standby\nnodeC max_slots=2\n")
    assert [(e.name, e.slots) for e in entries] == [("nodeA", 4), ("nodeB", None), ("nodeC", 2)]
    for step, complete in ((2, True), (4, True), (6, False)):   # step-6: a save cut short
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"x")
            certify(tmp_path / f"step-{step}", step)
    (tmp_path / "step-9.tmp").mkdir()
    assert newest_restart_point(tmp_path) == 4
    (tmp_path / "step-8").mkdir()  # complete but model-only, then complete but not certified
    (tmp_path / "step-8" / ".metadata").write_bytes(b"x")
    certify(tmp_path / "step-8", 8, restart_point=False)
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / ".metadata").write_bytes(b"x")
    assert newest_restart_point(tmp_path) == 4
    assert newest_restart_point(tmp_path / "missing") is None
    assert newest_restart_point(None) is None
    assert daemon_hosts(LOST_DAEMON) == {"rh22bn2"}
    assert daemon_hosts(FAILED_DAEMON) == {"rh22bn2"}
    assert daemon_hosts("step 3 loss 8.0") == set()


def _procs(hosts):
    return [{"host": h, "pid": 100 + i, "start": 7} for i, h in enumerate(hosts)]


def test_lost_hosts_from_every_kind_of_evidence():
    base = dict(aliases=ALIASES, launcher_host="n0", ranks_per_replica=1)
    daemon = Evidence(log_text=LOST_DAEMON.replace("rh22bn2", "n2"),
                      procs=_procs(["n0", "n1", "n2"]), **base)
    assert lost_hosts(HOSTS, daemon) == {"10.0.0.3": "PRRTE lost its daemon"}
    dead = Evidence(procs=_procs(["n0", "n1", "n2"]), events=[{"dead_replicas": [1]}], **base)
    assert lost_hosts(HOSTS, dead) == {"10.0.0.2": "every rank on it was declared dead"}
    # ... unless Open MPI aborted a rank there as falsely accused: a detection, not the host
    accused = Evidence(procs=_procs(["n0", "n1", "n2"]), events=[{"dead_replicas": [1, 2]}],
                       log_text=FALSELY_ACCUSED, **base)
    assert lost_hosts(HOSTS, accused) == {"10.0.0.3": "every rank on it was declared dead"}
    # a 2 x 2 job with replica 1 across n1 and n2: one dead replica loses both hosts' ranks
    split = Evidence(procs=_procs(["n0", "n0", "n1", "n2"]), events=[{"dead_replicas": [1]}],
                     **{**base, "ranks_per_replica": 2})
    assert set(lost_hosts(HOSTS, split)) == {"10.0.0.2", "10.0.0.3"}
    startup = Evidence(start_records={0: {"host": "n0", "pid": 1, "start": 1, "exited": "x"},
                                      1: {"host": "n1", "pid": 2, "start": 1, "exited": "x"},
                                      2: {"host": "n2", "pid": 3, "start": 1}}, **base)
    assert lost_hosts(HOSTS, startup) == {"10.0.0.3": "rank 2 died during start-up"}
    # [Note: start-up records]: rank 1 was ended with the job while it still waited (no
    # "exited"); the ranks that left saw only rank 2 fail: n1 is not lost
    waited = Evidence(start_records={
        0: {"host": "n0", "pid": 1, "start": 1, "exited": "x", "saw_failed": [2]},
        1: {"host": "n1", "pid": 2, "start": 1},
        2: {"host": "n2", "pid": 3, "start": 1},
        3: {"host": "n0", "pid": 4, "start": 1, "exited": "y", "saw_failed": [2]}}, **base)
    assert lost_hosts(HOSTS, waited) == {"10.0.0.3": "rank 2 died during start-up"}
    quiet = Evidence(unanswered={"10.0.0.4"}, procs=_procs(["n0", "n1", "n2"]), **base)
    assert lost_hosts(HOSTS, quiet) == {"10.0.0.4": "did not answer the launcher's probe"}
    # mpirun's own host is never lost: the launcher runs there
    own = Evidence(procs=_procs(["n0", "n1"]), events=[{"dead_replicas": [0]}], **base)
    assert lost_hosts(HOSTS, own) == {}


def test_plan_uses_standby_hosts_keeps_replicas_that_fit_and_is_bounded():
    entries = [HostEntry(h, f"{h} slots=8", 8) for h in HOSTS]
    lost = {"10.0.0.3": "PRRTE lost its daemon"}
    plan = plan_relaunch(entries, lost, 1, 3, 1, 4, 0, 2)   # ppr:1:node, standby 10.0.0.4
    assert [e.name for e in plan.hosts] == ["10.0.0.1", "10.0.0.2", "10.0.0.4"]
    assert (plan.replicas, plan.resume_step) == (3, 4)
    two = plan_relaunch(entries[:3], lost, 1, 3, 1, None, 1, 2)  # no standby, no checkpoint
    assert (two.replicas, two.resume_step) == (2, 0)
    assert "used up" in plan_relaunch(entries, lost, 1, 3, 1, 4, 2, 2)
    assert "no host left" in plan_relaunch(entries[:1], {"10.0.0.1": "x"}, 1, 3, 1, 4, 0, 2)
    assert plan_relaunch(entries, {}, 1, 3, 1, None, 0, 2, hopeless="x") == "x"
    config = {r: {"host": "n0", "exited": "SystemExit: 2"} for r in range(3)}
    assert "configuration error" in ends_the_same_way(config, False, 0)
    assert ends_the_same_way(config, True, 0) is None          # it trained: relaunch
    crashed = {**config, 1: {"host": "n1"}}       # one ended by mpirun: the others refuse again
    assert "configuration error" in ends_the_same_way(crashed, False, 0)
    assert ends_the_same_way(crashed, False, 1) is None        # a host lost: relaunch without it
    started = {r: {"host": "n0"} for r in range(3)}            # a start-up crash: relaunch
    assert ends_the_same_way(started, False, 0) is None
    assert ends_the_same_way({}, False, 0) is None             # died inside MPI_Init: relaunch
    one_host = [HostEntry("me", "me")]              # no hostfile: mpirun oversubscribes
    assert plan_relaunch(one_host, {}, 2, 3, None, 0, 0, 1).replicas == 3
    # slots decide without a ppr mapping: 2 + 2 ranks = 2 replicas of 2
    slots = [HostEntry("a", "a slots=2", 2), HostEntry("b", "b slots=2", 2)]
    assert plan_relaunch(slots, {}, 2, 3, None, 0, 0, 1).replicas == 2
    assert ranks_per_host_of(["--map-by", "ppr:2:node"], 0, 1) == 2
    assert ranks_per_host_of(["--map-by=ppr:3:node"], 0, 1) == 3
    assert ranks_per_host_of(["--map-by", "slot"], 4, 2) == 8
    assert ranks_per_host_of([], 0, 1) is None


def test_merge_keeps_every_step_once():
    first = [{"step": s, "loss": s, "a": 0} for s in range(1, 7)]      # died after step 6
    second = [{"step": s, "loss": s, "a": 1} for s in range(5, 9)]     # resumed from step 4
    third = [{"step": s, "loss": s, "a": 2} for s in range(9, 11)]     # resumed from step 8
    merged = merge_steps([first, second, third], [4, 8])
    assert [r["step"] for r in merged] == list(range(1, 11))
    assert [r["a"] for r in merged] == [0] * 4 + [1] * 4 + [2] * 2
    ledger = merge_steps([[{"step": s} for s in range(0, 6)], [{"step": s} for s in (4, 5)]],
                         [4], offset=1)
    assert [r["step"] for r in ledger] == [0, 1, 2, 3, 4, 5]


def test_agent_is_the_one_mpirun_uses():
    assert ssh_agent(["--prtemca", "plm_ssh_agent", "/x/agent.sh", "--map-by", "node"]) == \
        ["/x/agent.sh"]
    assert ssh_agent([], environ={}) == ["ssh"]
    assert ssh_agent([], environ={"PRTE_MCA_plm_ssh_agent": "rsh : ssh"}) == ["rsh"]


class FakeJob:
    """Attempt k of a job: writes the outputs an mpirun attempt would have written."""

    def __init__(self, out: Path, ckpt: Path, script, checkpoints: bool = True,
                 memory_interval: int = 0):
        self.out, self.ckpt, self.script, self.commands = out, ckpt, script, []
        self.checkpoints, self.memory_interval = checkpoints, memory_interval

    def build_job(self, args):
        if args.replicas < 1:
            from recover_hsdp.config import ConfigError
            raise ConfigError("bad")
        job = argparse.Namespace(
            recover=argparse.Namespace(tiers=argparse.Namespace(
                max_relaunches=2, memory_snapshot_interval=self.memory_interval,
                memory_snapshot_dir=str(self.out.parent / "shm")),
                                       timeouts=argparse.Namespace(detect_s=4.0,
                                                                   slow_phase_s=30.0),
                                       ranks_per_replica=1, initial_replicas=0),
            parallelism=argparse.Namespace(tensor_parallel_degree=1),
            training=argparse.Namespace(global_batch_size=-1, local_batch_size=2),
            checkpoint=argparse.Namespace(enable=self.checkpoints, folder=str(self.ckpt)),
            job=argparse.Namespace(dump_folder=str(self.out)))
        self.commands.append(args)
        return ["fake"], self.out, job

    def supervise(self, command, env, out, grace, tail=None, on_poll=None, should_end=None):
        args = self.commands[-1]
        steps, log, procs, summary = self.script[len(self.commands) - 1](args)
        (out / "procs.json").write_text(json.dumps(procs))
        with open(out / "faults_fired.jsonl", "w") as f:   # a fault of a step run fired
            for spec in map(FaultSpec.parse, args.fault):
                if spec.step in steps:
                    f.write(json.dumps({"replica": spec.replica, "step": spec.step,
                                        "phase": spec.phase.value, "mode": spec.mode.value}) + "\n")
        with open(out / "metrics.jsonl", "w") as f:
            for step in steps:
                f.write(json.dumps({"step": step, "loss": float(step),
                                    "alive_replicas": args.replicas}) + "\n")
                f.flush()
                if on_poll:
                    on_poll()
                if step % 4 == 0:
                    (self.ckpt / f"step-{step}").mkdir(parents=True, exist_ok=True)
                    (self.ckpt / f"step-{step}" / ".metadata").write_text("m")
                    certify(self.ckpt / f"step-{step}", step)
        (out / "ledger.jsonl").write_text("".join(json.dumps({"step": s - 1}) + "\n"
                                                  for s in steps))
        if summary:
            (out / "summary.json").write_text(json.dumps({"completed": True, "steps": len(steps),
                                                          "final_loss": 1.0, "tokens_per_s": 1,
                                                          "wall_s": 1}))
        tail.extend(log.splitlines(True))
        return 0


def test_driver_relaunches_from_the_newest_restart_point(tmp_path, monkeypatch):
    """A lost daemon after step 6 (checkpoint 4 complete): the next attempt runs on the other
    hosts plus the standby one, from step 4, the old job's processes ended on the hosts that
    answer; the outputs read as one run with the relaunch recorded."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} slots=8\n" for h in HOSTS))
    killed = {}
    monkeypatch.setattr(remote, "host_names", lambda agent, hosts, timeout=0: dict(ALIASES))
    monkeypatch.setattr(remote, "kill_remote", lambda agent, by_host, timeout=0:
                        killed.update(by_host) or {h: [p for p, _ in v] for h, v in by_host.items()})
    monkeypatch.setattr(attempts.socket, "gethostname", lambda: "n0")
    lost_daemon = LOST_DAEMON.replace("rh22bn2", "n2")
    job = FakeJob(out, ckpt, [
        lambda a: (range(1, 7), lost_daemon, _procs(["n0", "n1", "n2"]), False),
        lambda a: (range(5, 11), "", _procs(["n0", "n1", "n3"]), True)])
    args = argparse.Namespace(
        replicas=3, ranks_per_replica=None, gpus_per_node=0, ranks_per_gpu=1, hostfile=None,
        mpi_arg=["--hostfile", str(hostfile), "--prtemca", "plm_ssh_agent", "/agent",
                 "--map-by", "ppr:1:node"],
        fault=["replica=2,step=3,phase=forward"], overrides=["--training.steps", "10"],
        end_grace=1.0)
    attempts.train_with_relaunch(args, job.build_job, job.supervise, {})
    second = job.commands[1]
    assert second.replicas == 3 and second.fault == []
    assert second.overrides[-2:] == ["--checkpoint.load_step", "4"]
    assert Path(second.hostfile).read_text().split() == [
        "10.0.0.1", "slots=8", "10.0.0.2", "slots=8", "10.0.0.4", "slots=8"]
    assert "--hostfile" not in second.mpi_arg
    assert set(killed) == {"10.0.0.1", "10.0.0.2", "10.0.0.3"}    # every host that answers
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert [m["alive_replicas"] for m in metrics] == [3] * 10
    ledger = [json.loads(x)["step"] for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert ledger == list(range(10))
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    (record,) = [e for e in events if e.get("phase") == "relaunch"]
    assert record["lost_hosts"] == {"10.0.0.3": "PRRTE lost its daemon"}
    assert (record["resume_step"], record["last_step"], record["steps_lost"]) == (4, 6, 2)
    assert record["failure_to_training_s"] is not None and record["failure_to_training_s"] >= 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["attempts"] == 2
    assert [r["attempt"] for r in summary["relaunches"]] == [1]
    assert (out / "relaunch" / "attempt-0" / "mpirun-tail.log").read_text() == lost_daemon



def _three_hosts_answering(tmp_path, monkeypatch):
    """An output folder, a checkpoint folder and a hostfile of 3 hosts that all answer the
    launcher (nothing to kill), the launcher on n0."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} slots=8\n" for h in HOSTS[:3]))
    monkeypatch.setattr(remote, "host_names", lambda agent, hosts, timeout=0:
                        {h: ALIASES[h] for h in hosts})
    monkeypatch.setattr(remote, "kill_remote", lambda agent, by_host, timeout=0: {})
    monkeypatch.setattr(attempts.socket, "gethostname", lambda: "n0")
    return out, ckpt, hostfile


def _train_args(hostfile, ranks_per_replica, per_node):
    """``recover-hsdp train`` arguments for 3 replicas, ``per_node`` ranks on each host of
    ``hostfile``, 10 steps."""
    return argparse.Namespace(
        replicas=3, ranks_per_replica=ranks_per_replica, gpus_per_node=0, ranks_per_gpu=1,
        hostfile=None, mpi_arg=["--hostfile", str(hostfile), "--prtemca", "plm_ssh_agent",
                                "/agent", "--map-by", f"ppr:{per_node}:node"],
        fault=[], overrides=["--training.steps", "10"], end_grace=1.0)


def test_a_relaunch_onto_fewer_replicas_keeps_b_without_a_checkpoint(tmp_path, monkeypatch,
                                                                     capsys):
    """[Note: the relaunch keeps B]: 3 replicas, no standby host, no checkpoint, node 2 lost
    after step 3: the relaunch from step 0 runs 2 replicas with recover.initial_replicas = 3
    (B = 3 x G_init, a minor), never training.global_batch_size, whatever B's divisibility."""
    out, ckpt, hostfile = _three_hosts_answering(tmp_path, monkeypatch)
    job = FakeJob(out, ckpt, [
        lambda a: (range(1, 4), LOST_DAEMON.replace("rh22bn2", "n2"),
                   _procs(["n0", "n1", "n2"]), False),
        lambda a: (range(1, 11), "", _procs(["n0", "n1"]), True)], checkpoints=False)
    args = _train_args(hostfile, ranks_per_replica=None, per_node=1)
    assert attempts.train_with_relaunch(args, job.build_job, job.supervise, {}) == 0
    second = job.commands[1]
    assert second.replicas == 2
    assert second.overrides == ["--training.steps", "10", "--recover.initial_replicas", "3"]
    assert not any("global_batch_size" in o or "load_step" in o for o in second.overrides)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["relaunches"][0]["resume_step"] == 0
    said = [x for x in capsys.readouterr().out.splitlines() if "checkpoint.enable = false" in x]
    assert len(said) == 1 and "relaunches the run from step 0" in said[0]  # once, at start


def test_driver_relaunches_from_the_survivors_host_memory(tmp_path, monkeypatch, capsys):
    """[Note: host-memory state]: no checkpoint, snapshots every 2 steps; node 2 lost after
    step 5. The launcher lists the hosts not lost (node 2 is not asked) and relaunches from the
    newest generation every shard position has somewhere (6 is on one host only for shard 1:
    4), on the hosts left, with ``resume_from_memory``; the job's folder is removed on every
    host it reaches at the start and the end, and said nothing about a node loss at start."""
    out, ckpt, hostfile = _three_hosts_answering(tmp_path, monkeypatch)
    listed, removed = [], []
    files = {"10.0.0.1": ["/s/j/n0/gen-000000004/r0-s0.pt", "/s/j/n0/gen-000000004/r0-s1.pt",
                          "/s/j/n0/gen-000000006/r0-s0.pt"],
             "10.0.0.2": ["/s/j/n1/gen-000000002/r1-s1.pt", "/s/j/n1/gen-000000004/r1-s1.pt"],
             "10.0.0.3": ["/s/j/n2/gen-000000006/r2-s1.pt"]}
    monkeypatch.setattr(remote, "list_host_state", lambda agent, hosts, root, timeout=0:
                        listed.append(list(hosts)) or {h: files[h] for h in hosts})
    monkeypatch.setattr(remote, "remove_host_state", lambda agent, hosts, root, timeout=0:
                        removed.append((list(hosts), root)) or {})
    job = FakeJob(out, ckpt, [
        lambda a: (range(1, 6), LOST_DAEMON.replace("rh22bn2", "n2"),
                   _procs(["n0", "n0", "n1", "n1", "n2", "n2"]), False),
        lambda a: (range(5, 11), "", _procs(["n0", "n0", "n1", "n1"]), True)],
        checkpoints=False, memory_interval=2)
    args = _train_args(hostfile, ranks_per_replica=2, per_node=2)
    assert attempts.train_with_relaunch(args, job.build_job, job.supervise, {}) == 0
    second = job.commands[1]
    assert second.replicas == 2
    assert second.overrides == ["--training.steps", "10", "--recover.tiers.resume_from_memory",
                                "4", "--recover.initial_replicas", "3"]
    assert listed == [["10.0.0.1", "10.0.0.2"]]                  # the lost host is not asked
    root = str(host_files.job_root(tmp_path / "shm", out))
    assert removed == [(HOSTS[:3], root), (HOSTS[:2], root)]     # at the start, at the end
    summary = json.loads((out / "summary.json").read_text())
    (record,) = summary["relaunches"]
    assert record["from_memory"] and (record["resume_step"], record["steps_lost"]) == (4, 1)
    assert "relaunches the run from step 0" not in capsys.readouterr().out


def test_the_relaunch_prefers_the_newer_of_memory_and_checkpoint():
    entries = [HostEntry(h, h) for h in HOSTS]
    plan = relaunch.plan_relaunch(entries, {"10.0.0.3": "x"}, 1, 3, 1, 4, 0, 2, memory_step=6)
    assert (plan.resume_step, plan.from_memory, plan.replicas) == (6, True, 3)
    plan = relaunch.plan_relaunch(entries, {}, 1, 3, 1, 4, 0, 2, memory_step=4)
    assert (plan.resume_step, plan.from_memory) == (4, True)     # a tie: local memory
    plan = relaunch.plan_relaunch(entries, {}, 1, 3, 1, 8, 0, 2, memory_step=6)
    assert (plan.resume_step, plan.from_memory) == (8, False)
    plan = relaunch.plan_relaunch(entries, {}, 1, 3, 1, None, 0, 2, memory_step=None)
    assert (plan.resume_step, plan.from_memory) == (0, False)


def test_what_a_node_loss_costs_is_said_at_start():
    assert relaunch.node_loss_cost(checkpoints=True, max_relaunches=2) is None
    assert relaunch.node_loss_cost(checkpoints=False, max_relaunches=2, memory_interval=5) is None
    assert "memory_snapshot_interval" in relaunch.node_loss_cost(checkpoints=False,
                                                                 max_relaunches=2)
    assert "from step 0" in relaunch.node_loss_cost(checkpoints=False, max_relaunches=2)
    assert "ends the run" in relaunch.node_loss_cost(checkpoints=True, max_relaunches=0)
    off = relaunch.node_loss_cost(checkpoints=False, max_relaunches=0)
    assert "ends the run" in off and "nothing is saved" in off


FALSELY_ACCUSED = ("[n1:123] [[1,1],4] ompi_proc_mark_as_failed: I have been reported dead by "
                   "someone else. This is abnormal: since the current rank is executing this "
                   "code, the failure detector made a mistake.\n")


def test_false_detection_at_start_up_widens_the_margins_and_loses_no_host(tmp_path, monkeypatch,
                                                                           capsys):
    """An attempt that ended before its first step because Open MPI aborted two live ranks it
    had been told were dead ([Note: detection margins by phase]): the hosts of the aborted ranks
    stay, the next attempt gets twice the start-up margin slow_phase_s and the same detect_s
    (one line), and a later relaunch keeps them."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} slots=8\n" for h in HOSTS))
    monkeypatch.setattr(remote, "host_names", lambda agent, hosts, timeout=0: dict(ALIASES))
    monkeypatch.setattr(remote, "kill_remote", lambda agent, by_host, timeout=0: {})
    monkeypatch.setattr(attempts.socket, "gethostname", lambda: "n0")

    def accused(args):  # no world yet: the aborted ranks' start records have no "exited"
        for rank, host in ((1, "n1"), (2, "n2")):
            (out / "start").mkdir(exist_ok=True)
            (out / "start" / f"rank{rank}.json").write_text(json.dumps(
                {"rank": rank, "host": host, "pid": 1, "start": 1}))
        return range(0), FALSELY_ACCUSED * 2, [], False

    job = FakeJob(out, ckpt, [accused, lambda a: (range(1, 3), LOST_DAEMON.replace("rh22bn2", "n3"),
                                                  _procs(["n0", "n1", "n2"]), False),
                              lambda a: (range(3, 11), "", _procs(["n0", "n1", "n2"]), True)])
    args = argparse.Namespace(
        replicas=3, ranks_per_replica=None, gpus_per_node=0, ranks_per_gpu=1, hostfile=None,
        mpi_arg=["--hostfile", str(hostfile), "--prtemca", "plm_ssh_agent", "/agent",
                 "--map-by", "ppr:1:node"], fault=["replica=1,step=2,phase=grad_sync"],
        overrides=[], end_grace=1.0)
    attempts.train_with_relaunch(args, job.build_job, job.supervise, {})
    second, third = job.commands[1], job.commands[2]
    # a fault fires once per run: kept by the relaunch after the start-up, fired in attempt 2
    assert second.fault == ["replica=1,step=2,phase=grad_sync"] and third.fault == []
    assert second.overrides[-4:] == ["--recover.timeouts.detect_s", "4",
                                     "--recover.timeouts.slow_phase_s", "60"]
    assert Path(second.hostfile).read_text().split()[::2] == [f"10.0.0.{i}" for i in (1, 2, 3, 4)]
    assert "2 live rank(s) were declared dead before the first step" in capsys.readouterr().out
    assert third.overrides[-4:] == second.overrides[-4:]          # kept by the next relaunch
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    first = [e for e in events if e.get("phase") == "relaunch"][0]
    assert first["lost_hosts"] == {} and (first["detect_s"], first["slow_phase_s"]) == (4, 60)


def test_driver_gives_up_after_max_relaunches(tmp_path, monkeypatch, capsys):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    monkeypatch.setattr(remote, "host_names", lambda agent, hosts, timeout=0:
                        {h: h for h in hosts})
    monkeypatch.setattr(remote, "kill_remote", lambda agent, by_host, timeout=0: {})
    job = FakeJob(out, ckpt, [lambda a: (range(1, 3), "", [], False)] * 3)
    args = argparse.Namespace(
        replicas=2, ranks_per_replica=None, gpus_per_node=0, ranks_per_gpu=1, hostfile=None,
        mpi_arg=[], fault=[], overrides=[], end_grace=1.0)
    attempts.train_with_relaunch(args, job.build_job, job.supervise, {})
    assert len(job.commands) == 3                    # the first attempt + max_relaunches = 2
    assert "used up" in capsys.readouterr().err
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("field, value, words", [
    ("max_relaunches", -1, "recover.tiers.max_relaunches=-1"),
    ("daemon_keepalive_s", 0.5, "recover.tiers.daemon_keepalive_s=0.5")])
def test_bad_relaunch_fields_are_one_line(field, value, words):
    from recover_hsdp.config import ConfigError, Tiers

    tiers = Tiers()
    setattr(tiers, field, value)
    with pytest.raises(ConfigError) as err:
        tiers.check()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_emergency_checkpoint_after_a_whole_host_is_lost():
    """[Note: emergency checkpoint]: a repair that empties a host makes the next step boundary
    save whatever the interval, once; a lost replica whose host keeps others does not."""
    from types import SimpleNamespace

    from recover_hsdp.collectives.processes import ProcessInfo
    from recover_hsdp.manager.local_processes import LocalProcesses
    from recover_hsdp.titan.trainer import ReplicaCheckpointer

    alive = [0, 1, 2, 3]
    world = SimpleNamespace(layout=SimpleNamespace(alive_ranks=lambda: list(alive)))
    table = [ProcessInfo(h, 10 + i, 1) for i, h in enumerate(["a", "a", "b", "c"])]
    processes = LocalProcesses(world, table)
    assert processes.hosts_emptied() == set()
    alive[:] = [0, 2, 3]            # rank 1 dies, host a keeps rank 0
    assert processes.hosts_emptied() == set()
    alive[:] = [0, 3]               # host b lost as a whole
    assert processes.hosts_emptied() == {"b"}
    assert processes.hosts_emptied() == set()   # once

    saved = []

    class Inner:
        enable, load_only, interval, last_save_model_only = True, False, 100, True
        states = {"dataloader": SimpleNamespace(gathers_state=False)}

        def _should_save(self, step, last_step=False):
            return last_step or step % self.interval == 0

        def save(self, step, last_step=False):
            if self._should_save(step, last_step):
                saved.append(step)

        def _create_checkpoint_id(self, step):
            return f"/nonexistent/step-{step}"

    import contextlib

    flags = [False, True, False]
    manager = SimpleNamespace(
        take_emergency_checkpoint=lambda: flags.pop(0), saves_checkpoints=True, shard=0,
        world=SimpleNamespace(watchdog_paused=contextlib.nullcontext),
        checkpoint_point=lambda step: None,
        save_checkpoint=lambda step, save: save() is None,  # the agreement: one replica
        emergency_checkpoint_saved=lambda step: told.append(step))
    told = []
    checkpointer = ReplicaCheckpointer(Inner(), manager)
    for step in (3, 4, 5):
        checkpointer.save(step)
    assert saved == [4] and checkpointer.interval == 100
    assert told == [4]          # the launcher is told of the emergency checkpoint only


def test_relaunch_request_ends_the_job_only_when_a_host_is_silent(tmp_path, monkeypatch):
    """[Note: emergency checkpoint]: after the writer's request the launcher asks the hosts;
    all answer -> the verdict "go on" for that step; one silent -> end mpirun (a reason)."""
    import time

    from recover_hsdp import handshake
    from recover_hsdp.cli import attempts

    answers = {"a": "a", "b": "b"}
    monkeypatch.setattr(attempts.remote, "host_names", lambda agent, hosts: dict(answers))
    request = attempts.RelaunchRequest(tmp_path, ["ssh"], ["a", "b"])
    assert request.check() is None                                  # no request yet
    handshake.write_request(tmp_path, 5, ["b"])
    assert request.check() is None                                  # every host answers
    assert json.loads((tmp_path / handshake.VERDICT).read_text()) == {"step": 5, "go_on": True}
    assert handshake.wait_for_verdict(tmp_path, 5, timeout_s=1.0)           # the writer reads it
    time.sleep(0.01)
    answers["b"] = None
    handshake.write_request(tmp_path, 9, ["b"])
    reason = request.check()
    assert reason is not None and "b lost" in reason and "step 9" in reason
    assert request.check() is None                                  # asked once per request


def test_the_writer_waits_for_the_launchers_verdict(tmp_path, monkeypatch):
    """[Note: emergency checkpoint] from the writer's side (``RecoverManager``): the request
    names the step and the emptied hosts; supervised, the writer returns once the launcher's
    verdict for that step is there (the launcher's side: the test above)."""
    import contextlib
    import threading
    import time
    from types import SimpleNamespace

    from recover_hsdp import handshake
    from recover_hsdp.manager import RecoverManager

    writer = SimpleNamespace(
        _emptied_hosts={"b"}, writer=SimpleNamespace(is_writer=True), out_dir=tmp_path,
        world=SimpleNamespace(watchdog_paused=contextlib.nullcontext))
    monkeypatch.delenv(handshake.SUPERVISED_ENV, raising=False)
    RecoverManager.emergency_checkpoint_saved(writer, 4)            # unsupervised: no wait
    assert handshake.read_request(tmp_path)[1]["step"] == 4 and writer._emptied_hosts == set()

    monkeypatch.setenv(handshake.SUPERVISED_ENV, "1")               # handshake.supervise()
    writer._emptied_hosts = {"c"}
    launcher = threading.Timer(0.2, handshake.write_verdict, (tmp_path, 8))
    started = time.monotonic()
    launcher.start()
    RecoverManager.emergency_checkpoint_saved(writer, 8)            # returns on the verdict
    assert 0.15 < time.monotonic() - started < handshake.VERDICT_WAIT_S
    launcher.join()
    assert handshake.read_request(tmp_path)[1]["hosts"] == ["c"]
    assert json.loads((tmp_path / handshake.VERDICT).read_text())["step"] == 8


def test_false_detection_relaunches_are_free_up_to_a_bound():
    """[Note: the relaunch tier]: the first MAX_WIDENINGS relaunches for false detections at
    start-up do not use up max_relaunches; later ones do; with the tier off nothing is free."""
    def rec(free):
        return relaunch.RelaunchRecord(attempt=1, cause="x", lost_hosts={}, hosts=[], replicas=1,
                                       resume_step=0, last_step=0, steps_lost=0, failure_at=0.0,
                                       ended_at=0.0, relaunched_at=0.0, false_detection=free)

    assert attempts._counted([], found=1, max_relaunches=2) == 0
    assert attempts._counted([rec(False), rec(False)], found=1, max_relaunches=2) == 1  # allowed
    assert attempts._counted([rec(False), rec(False)], found=0, max_relaunches=2) == 2  # used up
    assert attempts._counted([rec(True)] * 3, found=1, max_relaunches=2) == 0
    assert attempts._counted([rec(True)] * 3 + [rec(False)], found=0, max_relaunches=2) == 1
    assert attempts._counted([], found=1, max_relaunches=0) == 0  # tier off: refused (0 >= 0)


def test_a_host_slow_to_answer_once_is_asked_again_before_it_is_lost(tmp_path):
    """A loaded host can miss one probe: it is asked again with twice the time; one that never
    answers is lost. Real subprocesses through an ssh-like agent script."""
    agent = tmp_path / "agent.sh"
    agent.write_text("#!/bin/sh\nhost=$1\nf=" + str(tmp_path) + "/seen-$host\n"
                     "if [ \"$host\" = dead ]; then sleep 5; exit 1; fi\n"
                     "if [ ! -e $f ]; then touch $f; sleep 2; fi\necho name-$host\n")
    agent.chmod(0o755)
    answers = remote.host_names([str(agent)], ["slow", "dead"], timeout=0.6)
    assert answers == {"slow": "name-slow", "dead": None}


def test_ranks_crashed_inside_mpi_init_are_relaunched_with_the_same_margins():
    crash = ("[n0:21240] [ 1] /x/libmpi.so.40(ompi_comm_revoke_local+0x3f)[0x7ffac76745df]\n"
             "[n1:21272] [ 1] /x/libmpi.so.40(ompi_comm_revoke_local+0x3f)[0x7ff05b6745df]\n")
    assert relaunch.init_crashes(crash, progressed=False) == 2
    assert relaunch.init_crashes(crash, progressed=True) == 0
    overrides, line = relaunch.wider_margins(4.0, 30.0, 0, crashed=2)
    assert overrides == ["--recover.timeouts.detect_s", "4", "--recover.timeouts.slow_phase_s",
                         "30"] and "2 rank(s) crashed on a failure notice inside MPI_Init" in line
    assert "same margins" in line
    overrides, line = relaunch.wider_margins(4.0, 30.0, 1, crashed=2)  # a false detection too
    assert overrides[1::2] == ["4", "60"] and "slow_phase_s 30 -> 60 s" in line
    assert relaunch.wider_margins(4.0, 30.0, 0) == ([], "")
