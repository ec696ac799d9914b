"""``recover-hsdp train`` with the relaunch tier: the job's attempts, one mpirun each.

[Note: the relaunch tier] (``recover_hsdp.cli.relaunch``) decides; this module does the I/O:
it runs an attempt (``launch.supervise``, mpirun's output kept), gathers the evidence of an
abnormal end, ends the old job's processes on every host that answers, keeps the attempt's
outputs in ``relaunch/attempt-<k>/``, writes the next attempt's hostfile
(``relaunch/hostfile-<k>``) and, once an attempt completes (or the relaunches are used up),
merges the attempts' outputs into the output folder and records every relaunch.
:func:`run_attempt` runs one attempt and judges it (``AttemptResult``: COMPLETED, RELAUNCH
with the next attempt's command and record, or GIVE_UP with the reason);
:func:`train_with_relaunch` loops over them. The writer's relaunch request and the verdict
are files of recover_hsdp/handshake.py (``RelaunchRequest`` answers them).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import enum
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from recover_hsdp import handshake, host_files
from recover_hsdp.cli import hosts as remote
from recover_hsdp.cli import relaunch, slurm
from recover_hsdp.cli.hostfile import HostEntry, format_hostfile, read_hostfile
from recover_hsdp.collectives.processes import read_registry, read_start_records
from recover_hsdp.config import ConfigError, initial_replica_count
from recover_hsdp.outputs import clear_run_files, start_afresh

RELAUNCH_DIR = "relaunch"
MOVED = ("metrics.jsonl", "events.jsonl", "ledger.jsonl", "faults_fired.jsonl", "summary.json",
         "procs.json")


def hostfile_in_mpi_args(args: argparse.Namespace) -> None:
    """A ``--hostfile`` given through ``--mpi-arg`` becomes the launcher's own ``--hostfile``
    (the relaunch tier writes the next attempt's)."""
    mpi = list(args.mpi_arg)
    for index, arg in enumerate(mpi):
        if arg in ("--hostfile", "--machinefile") and index + 1 < len(mpi):
            if args.hostfile is None:
                args.hostfile = mpi[index + 1]
            del mpi[index:index + 2]
            break
        if arg.startswith(("--hostfile=", "--machinefile=")):
            args.hostfile = args.hostfile or arg.split("=", 1)[1]
            del mpi[index]
            break
    args.mpi_arg = mpi


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line
    return out


def _completed(out: Path) -> dict | None:
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("completed") else None


class Verdict(enum.Enum):
    """How an attempt ended, as the launcher judges it ([Note: the relaunch tier])."""

    COMPLETED = "completed"  # summary.json says completed
    RELAUNCH = "relaunch"    # ended abnormally; the next attempt is planned and built
    GIVE_UP = "give up"      # ended abnormally; no relaunch (why: ``reason``)


@dataclasses.dataclass
class AttemptResult:
    """One attempt's end (:func:`run_attempt`): mpirun's exit code, and for RELAUNCH the next
    attempt's command and the relaunch's record, for GIVE_UP the reason."""

    verdict: Verdict
    returncode: int
    command: list[str] | None = None
    record: relaunch.RelaunchRecord | None = None
    reason: str = ""


@dataclasses.dataclass
class Job:
    """What every attempt of one ``recover-hsdp train`` job shares (:func:`prepare_job`)."""

    args: argparse.Namespace      # the first attempt's (later ones are copies)
    build_job: Callable           # args -> (mpirun command, output folder, job config)
    supervise: Callable           # ``launch.supervise``: one mpirun, its exit code
    env: dict
    out: Path
    entries: list[HostEntry]      # the hostfile's hosts (standby ones too)
    agent: list[str]              # mpirun's ssh agent (reaches the hosts)
    ranks_per_replica: int
    per_host: int | None          # ranks per host of the GPU layout, else None
    initial_replicas: int         # W_init of the batch contract ([Note: the relaunch keeps B])
    checkpoints: Path | None      # the DCP folder
    memory_root: Path | None      # the job's host-memory folder on every host, None: off
    max_relaunches: int
    margins: tuple[float, float]  # the first attempt's detect_s, slow_phase_s
    fired: list[dict] = dataclasses.field(default_factory=list)  # faults_fired.jsonl, all attempts
    lost: dict[str, str] = dataclasses.field(default_factory=dict)  # hosts lost so far


def train_with_relaunch(args: argparse.Namespace, build_job, supervise, env: dict) -> int:
    """Run ``recover-hsdp train`` attempts until one completes ([Note: the relaunch tier]).
    Returns the launcher's exit code. The job's host-memory state is removed from every host
    it reaches when this returns or raises ([Note: host-memory state])."""
    job, command = prepare_job(args, build_job, supervise, env)
    try:
        return _attempts(job, command)
    finally:
        _remove_host_state(job)


def _attempts(job: Job, command: list[str]) -> int:
    records: list[relaunch.RelaunchRecord] = []
    while True:
        result = run_attempt(job, command, records)
        if result.verdict is not Verdict.RELAUNCH:
            break
        command, record = result.command, result.record
        # the old job's claims stay: a cut-off part of it may still be alive and must find the
        # majority's claim there and stop ([Note: split brain] in collectives/arbiter.py); so do
        # the operator's pending join requests: the new attempt answers them
        clear_run_files(job.out, keep=("membership", "join"))
        records.append(record)
        print(f"recover-hsdp: relaunch {record.attempt}/{job.max_relaunches}: {record.cause}; "
              f"{record.replicas} replica(s) on {', '.join(record.hosts)} from step "
              f"{record.resume_step} ({record.steps_lost} step(s) to redo)", flush=True)
    if result.verdict is Verdict.GIVE_UP:
        print(f"recover-hsdp: no relaunch: {result.reason}", file=sys.stderr, flush=True)
    if records:
        _merge(job.out, records)
    return result.returncode


def prepare_job(args: argparse.Namespace, build_job, supervise, env: dict
                ) -> tuple[Job, list[str]]:
    """The job's shared facts and the first attempt's command; the output folder emptied of an
    earlier run's files."""
    hostfile_in_mpi_args(args)
    handshake.supervise()  # exported to the ranks: [Note: emergency checkpoint]
    if args.hostfile is None and slurm.in_allocation():  # [Note: Slurm allocations]
        args.out = str(Path(args.out or Path("outputs") / Path(args.config).stem).resolve())
        args.hostfile = str(slurm.write_allocation_hostfile(Path(args.out)))
        args.mpi_arg = slurm.prted_step_overlaps(list(args.mpi_arg))
        print(f"recover-hsdp: Slurm allocation {os.environ.get('SLURM_JOB_ID', '?')}: its nodes "
              f"in {args.hostfile}", flush=True)
    command, out, config = build_job(args)
    rc = config.recover
    memory = rc.tiers.memory_snapshot_interval > 0
    ranks_per_replica = args.ranks_per_replica or rc.ranks_per_replica
    job = Job(
        args, build_job, supervise, env, out,
        entries=(read_hostfile(args.hostfile) if args.hostfile
                 else [HostEntry(socket.gethostname(), socket.gethostname())]),
        agent=remote.ssh_agent(args.mpi_arg), ranks_per_replica=ranks_per_replica,
        per_host=relaunch.ranks_per_host_of(args.mpi_arg, args.gpus_per_node or 0,
                                            args.ranks_per_gpu),
        initial_replicas=initial_replica_count(rc.initial_replicas, args.replicas),
        checkpoints=(Path(config.job.dump_folder) / config.checkpoint.folder
                     if config.checkpoint.enable else None),
        memory_root=(host_files.job_root(rc.tiers.memory_snapshot_dir, out) if memory else None),
        max_relaunches=rc.tiers.max_relaunches,
        margins=(rc.timeouts.detect_s, rc.timeouts.slow_phase_s))
    _fresh_outputs(out)
    _remove_host_state(job)  # an earlier run's, in the same output folder
    cost = relaunch.node_loss_cost(job.checkpoints is not None, job.max_relaunches,
                                   rc.tiers.memory_snapshot_interval)
    if cost:
        print(f"recover-hsdp: {cost}", flush=True)
    return job, command


def _fresh_outputs(out: Path) -> None:
    start_afresh(out, folders=(RELAUNCH_DIR,))  # the earlier run's attempts too
    (out / RELAUNCH_DIR).mkdir()


def run_attempt(job: Job, command: list[str], records: list[relaunch.RelaunchRecord]
                ) -> AttemptResult:
    """Run one attempt (``records``: the relaunches so far) and judge how it ended: completed,
    or the evidence gathered, the old job ended, and the next attempt planned (or none)."""
    out = job.out
    print("+ " + " ".join(command), flush=True)
    tail: collections.deque = collections.deque(maxlen=400)
    first_step: list[float] = []

    def watch() -> None:
        if not first_step and records and (out / "metrics.jsonl").exists() and \
                (out / "metrics.jsonl").stat().st_size > 0:
            first_step.append(time.time())

    gone = records[-1].lost_hosts if records else {}
    request = RelaunchRequest(out, job.agent, [e.name for e in job.entries if e.name not in gone])
    returncode = job.supervise(command, job.env, out, job.args.end_grace, tail=tail,
                               on_poll=watch, should_end=request.check)
    ended_at = time.time()
    if records:
        _training_again(records[-1], first_step)
    if _completed(out) is not None:
        return AttemptResult(Verdict.COMPLETED, returncode)
    return _judge(job, records, request, "".join(tail), returncode, ended_at)


def _judge(job: Job, records: list[relaunch.RelaunchRecord], request: RelaunchRequest,
           log_text: str, returncode: int, ended_at: float) -> AttemptResult:
    """[Note: the relaunch tier] steps 1-3 after an abnormal end."""
    out, entries = job.out, job.entries
    # who answers, as whom (asked already if the job was ended on the writer's request)
    aliases = request.answers or remote.host_names(job.agent, [e.name for e in entries])
    attempt = len(records)
    progressed = bool(_read_jsonl(out / "metrics.jsonl"))
    evidence = relaunch.Evidence(
        log_text=log_text, procs=[p.__dict__ for p in read_registry(out)],
        start_records=read_start_records(out), events=_read_jsonl(out / "events.jsonl"),
        unanswered={h for h, n in aliases.items() if n is None},
        aliases={h: n for h, n in aliases.items() if n}, launcher_host=socket.gethostname(),
        ranks_per_replica=job.ranks_per_replica,
        false_detections=relaunch.false_detections(log_text, progressed),
        init_crashes=relaunch.init_crashes(log_text, progressed))
    lost_before = records[-1].lost_hosts if records else {}
    new = relaunch.lost_hosts([e.name for e in entries if e.name not in lost_before], evidence)
    lost = {**lost_before, **new}
    job.lost.update(lost)
    _end_old_job(job.agent, evidence, entries, out)
    last_step = max((s["step"] for s in _read_jsonl(out / "metrics.jsonl")),
                    default=(records[-1].resume_step if records else 0))
    hopeless = relaunch.ends_the_same_way(evidence.start_records, progressed, len(new))
    plan = relaunch.plan_relaunch(entries, lost, job.ranks_per_replica,
                                  job.args.replicas, job.per_host,
                                  relaunch.newest_restart_point(job.checkpoints),
                                  _counted(records, evidence.false_detections
                                           + evidence.init_crashes,
                                           job.max_relaunches),
                                  job.max_relaunches, hopeless,
                                  memory_step=_newest_host_state(job, lost))
    if not isinstance(plan, str) and not plan.from_memory:
        _remove_host_state(job)  # never mixed with an older start: [Note: host-memory state]
    _keep_attempt(out, attempt, log_text)
    job.fired += _read_jsonl(out / "faults_fired.jsonl")
    # [Note: divergence votes]: replicas that disagree with no strict majority end the job;
    # the relaunch goes back to the newest certified checkpoint (the trainer verifies it)
    refused = next((r["exited"].split(": ", 1)[1] for r in evidence.start_records.values()
                    if r.get("exited", "").startswith("NoMajority")), "")
    if isinstance(plan, str):
        return AttemptResult(Verdict.GIVE_UP, returncode,
                             reason=f"{refused}; {plan}" if refused else plan)
    cause = "; ".join(f"{h}: {why}" for h, why in new.items()) or refused or \
        f"mpirun ended (exit code {returncode}) without a completed summary"
    record = relaunch.RelaunchRecord(
        attempt=attempt + 1, cause=cause, lost_hosts=lost,
        hosts=[e.name for e in plan.hosts], replicas=plan.replicas,
        resume_step=plan.resume_step, from_memory=plan.from_memory, last_step=last_step,
        steps_lost=max(0, last_step - plan.resume_step),
        failure_at=relaunch.failure_time(evidence.events, ended_at, set(lost)),
        ended_at=ended_at, relaunched_at=time.time())
    return _next_attempt(job, plan, record, returncode, _margins(
        job, records, record, evidence.false_detections, evidence.init_crashes))


MAX_WIDENINGS = 3  # relaunches for false detections that do not count against max_relaunches


def _counted(records: list[relaunch.RelaunchRecord], found: int, max_relaunches: int) -> int:
    """The relaunches so far that count against ``max_relaunches``: the first
    :data:`MAX_WIDENINGS` for false detections at start-up do not, and neither does this one if
    it is such a relaunch (``found``); with the tier off (0) nothing is free."""
    free = min(sum(r.false_detection for r in records), MAX_WIDENINGS)
    done = len(records) - free
    if max_relaunches and found and free < MAX_WIDENINGS:
        return min(done, max_relaunches - 1)
    return done


def _margins(job: Job, records: list[relaunch.RelaunchRecord], record: relaunch.RelaunchRecord,
             found: int, crashed: int = 0) -> list[str]:
    """The detection margins of the next attempt: the last relaunch's (or the job's), doubled
    after false detections at start-up (the line printed, the record updated)."""
    last = next((r for r in reversed(records) if r.detect_s is not None), None)
    detect_s, slow_s = (last.detect_s, last.slow_phase_s) if last else job.margins
    overrides, line = relaunch.wider_margins(detect_s, slow_s, found, crashed)
    if line:
        print(line, flush=True)
        record.detect_s, record.slow_phase_s = float(overrides[1]), float(overrides[3])
        record.false_detection = True
        return overrides
    if last:  # keep the wider margins of an earlier relaunch
        record.detect_s, record.slow_phase_s = detect_s, slow_s
        return relaunch.margin_overrides(detect_s, slow_s)
    return []


def _next_attempt(job: Job, plan: relaunch.Plan, record: relaunch.RelaunchRecord,
                  returncode: int, margins: list[str] = ()) -> AttemptResult:
    """The relaunch's arguments and command (the plan's hosts, replicas and resume step)."""
    args = job.args
    current = copy.copy(args)
    current.replicas = plan.replicas
    current.fault = relaunch.unfired_faults(args.fault, job.fired)  # each fires once per run
    current.hostfile = str(_write_hostfile(job.out, record.attempt, plan.hosts)) \
        if args.hostfile else None
    current.overrides = [*args.overrides]
    if plan.from_memory:  # [Note: host-memory state] (recovery/host_state.py)
        current.overrides += ["--recover.tiers.resume_from_memory", str(plan.resume_step)]
    elif plan.resume_step:
        current.overrides += ["--checkpoint.load_step", str(plan.resume_step)]
    if plan.replicas < job.initial_replicas:  # [Note: the relaunch keeps B] (relaunch.py)
        current.overrides += ["--recover.initial_replicas", str(job.initial_replicas)]
    current.overrides += list(margins)
    try:
        command, _, _ = job.build_job(current)
    except ConfigError as err:
        return AttemptResult(Verdict.GIVE_UP, returncode, reason=str(err))
    return AttemptResult(Verdict.RELAUNCH, returncode, command=command, record=record)


class RelaunchRequest:
    """The writer's word that an emergency checkpoint is complete ([Note: emergency checkpoint]
    in manager/manager.py; the files: recover_hsdp/handshake.py): if a host of the job then
    does not answer the agent, PRRTE will end the job when it notices the lost daemon
    (``daemon_keepalive_s`` later), so the launcher ends it now and relaunches from that
    checkpoint, redoing no step. A host that answers (its ranks died, its daemon lives) leaves
    the in-job tier to carry on."""

    def __init__(self, out: Path, agent: list[str], hosts: list[str]) -> None:
        self.out, self.agent, self.hosts = out, agent, hosts
        handshake.clear(out)  # an earlier attempt's
        self._seen: float | None = None
        self.answers: dict[str, str | None] | None = None  # the hosts' answers that ended it

    def check(self) -> str | None:
        new = handshake.read_request(self.out, self._seen)
        if new is None:
            return None
        self._seen, request = new
        answers = remote.host_names(self.agent, self.hosts)
        silent = [h for h, name in answers.items() if name is None]
        if not silent:  # its ranks died, its daemon lives: the in-job tier carries on
            handshake.write_verdict(self.out, request["step"])
            return None
        self.answers = answers
        return (f"host(s) {', '.join(silent)} lost (no answer) after step {request['step']}'s "
                "emergency checkpoint: ending the job to relaunch from it")


def _newest_host_state(job: Job, lost: dict[str, str]) -> int | None:
    """The newest host-memory generation complete on the hosts not lost ([Note: host-memory
    state]), listed over the agent; None if off or none."""
    if job.memory_root is None:
        return None
    hosts = [e.name for e in job.entries if e.name not in lost]
    listings = remote.list_host_state(job.agent, hosts, str(job.memory_root))
    return host_files.newest_complete(
        (host_files.parse_listing(paths) for paths in listings.values() if paths),
        job.ranks_per_replica)


def _remove_host_state(job: Job) -> None:
    """The job's host-memory folder removed here and on every host not known lost (a lost
    host cannot be reached; its memory goes with it)."""
    if job.memory_root is not None:
        remote.remove_host_state(job.agent, [e.name for e in job.entries
                                             if e.name not in job.lost], str(job.memory_root))


def _training_again(record: relaunch.RelaunchRecord, first_step: list[float]) -> None:
    if first_step:
        record.training_again_at = first_step[0]
        record.failure_to_training_s = first_step[0] - record.failure_at


def _end_old_job(agent, evidence: relaunch.Evidence, entries, out: Path) -> None:
    """[Note: the relaunch tier] step 2: no process of the old job survives on a host that
    answers (procs.json and the start-up records)."""
    by_name = {evidence.aliases.get(e.name, e.name): e.name for e in entries}
    procs = [*evidence.procs, *evidence.start_records.values()]
    by_host: dict[str, set[tuple[int, int]]] = {}
    for proc in procs:
        host = by_name.get(proc["host"])
        if host is not None and host not in evidence.unanswered:
            by_host.setdefault(host, set()).add((proc["pid"], proc["start"]))
    killed = remote.kill_remote(agent, {h: sorted(p) for h, p in by_host.items()})
    killed = {h: pids for h, pids in killed.items() if pids}
    if killed:
        print(f"recover-hsdp: ended processes of the old job: {killed}", flush=True)


def _keep_attempt(out: Path, attempt: int, log_text: str) -> None:
    folder = out / RELAUNCH_DIR / f"attempt-{attempt}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in MOVED:
        if (out / name).exists():
            shutil.copy2(out / name, folder / name)
    (folder / "mpirun-tail.log").write_text(log_text)


def _write_hostfile(out: Path, attempt: int, entries) -> Path:
    path = out / RELAUNCH_DIR / f"hostfile-{attempt}"
    path.write_text(format_hostfile(entries))
    return path


def _merge(out: Path, records: list[relaunch.RelaunchRecord]) -> None:
    """The attempts' outputs as one run: every step once, every relaunch recorded."""
    attempts = [out / RELAUNCH_DIR / f"attempt-{k}" for k in range(len(records))] + [out]
    resumes = [r.resume_step for r in records]
    metrics = relaunch.merge_steps([_read_jsonl(a / "metrics.jsonl") for a in attempts], resumes)
    ledger = relaunch.merge_steps([_read_jsonl(a / "ledger.jsonl") for a in attempts], resumes,
                                  offset=1)
    events = []
    for index, folder in enumerate(attempts):
        events += [{**e, "attempt": index} for e in _read_jsonl(folder / "events.jsonl")]
        if index < len(records):
            events.append(records[index].event())
    for name, rows in (("metrics.jsonl", metrics), ("ledger.jsonl", ledger),
                       ("events.jsonl", events)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary_path = out / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        summary.update(steps=len(metrics), attempts=len(records) + 1,
                       relaunches=[r.event() for r in records])
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
