"""``recover-hsdp train`` with the relaunch tier: the job's attempts, one mpirun each.

[Note: the relaunch tier] (``recover_hsdp.cli.relaunch``) decides; this module does the I/O:
it runs an attempt (``launch.supervise``, mpirun's output kept), gathers the evidence of an
abnormal end, ends the old job's processes on every host that answers, keeps the attempt's
outputs in ``relaunch/attempt-<k>/``, writes the next attempt's hostfile
(``relaunch/hostfile-<k>``) and, once an attempt completes (or the relaunches are used up),
merges the attempts' outputs into the output folder and records every relaunch.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from recover_hsdp.cli import hosts as remote
from recover_hsdp.cli import relaunch, slurm
from recover_hsdp.collectives.processes import read_registry, read_start_records
from recover_hsdp.config import ConfigError, data_ranks_per_replica
from recover_hsdp.outputs import (RELAUNCH_REQUEST, RELAUNCH_VERDICT, SUPERVISED_ENV,
                                  clear_run_files, write_json_atomic)

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


def train_with_relaunch(args: argparse.Namespace, build_job, supervise, env: dict) -> int:
    """Run ``recover-hsdp train`` attempts until one completes ([Note: the relaunch tier]).
    Returns the launcher's exit code."""
    hostfile_in_mpi_args(args)
    os.environ[SUPERVISED_ENV] = "1"  # exported to the ranks: [Note: emergency checkpoint]
    if args.hostfile is None and slurm.in_allocation():  # [Note: Slurm allocations]
        args.out = str(Path(args.out or Path("outputs") / Path(args.config).stem).resolve())
        args.hostfile = str(slurm.write_allocation_hostfile(Path(args.out)))
        args.mpi_arg = slurm.prted_step_overlaps(list(args.mpi_arg))
        print(f"recover-hsdp: Slurm allocation {os.environ.get('SLURM_JOB_ID', '?')}: its nodes "
              f"in {args.hostfile}", flush=True)
    command, out, job = build_job(args)
    rc = job.recover
    entries = (relaunch.parse_hostfile(Path(args.hostfile).read_text()) if args.hostfile
               else [relaunch.HostEntry(socket.gethostname(), socket.gethostname())])
    agent = remote.ssh_agent(args.mpi_arg)
    ranks_per_replica = args.ranks_per_replica or rc.ranks_per_replica
    per_host = relaunch.ranks_per_host_of(args.mpi_arg, args.gpus_per_node or 0,
                                          args.ranks_per_gpu)
    fsdp = data_ranks_per_replica(ranks_per_replica, job.parallelism.tensor_parallel_degree)
    batch = (job.training.global_batch_size if job.training.global_batch_size > 0
             else job.training.local_batch_size * args.replicas * fsdp)
    folder = (Path(job.job.dump_folder) / job.checkpoint.folder
              if job.checkpoint.enable else None)
    out.mkdir(parents=True, exist_ok=True)
    removed = clear_run_files(out)  # an earlier run's outputs never mix with this one's
    if (out / RELAUNCH_DIR).is_dir():
        shutil.rmtree(out / RELAUNCH_DIR)
        removed.append(f"{RELAUNCH_DIR}/")
    if removed:
        print(f"recover-hsdp: {out}: removed the earlier run's {', '.join(removed)}", flush=True)
    (out / RELAUNCH_DIR).mkdir()
    records: list[relaunch.RelaunchRecord] = []
    returncode = 0
    while True:
        print("+ " + " ".join(command), flush=True)
        tail: collections.deque = collections.deque(maxlen=400)
        first_step: list[float] = []

        def watch() -> None:
            if not first_step and records and (out / "metrics.jsonl").exists() and \
                    (out / "metrics.jsonl").stat().st_size > 0:
                first_step.append(time.time())

        gone = records[-1].lost_hosts if records else {}
        request = RelaunchRequest(out, agent, [e.name for e in entries if e.name not in gone])
        returncode = supervise(command, env, out, args.end_grace, tail=tail, on_poll=watch,
                               should_end=request.check)
        ended_at = time.time()
        if records:
            _training_again(records[-1], first_step)
        if _completed(out) is not None:
            break
        # who answers, as whom (asked already if the job was ended on the writer's request)
        aliases = request.answers or remote.host_names(agent, [e.name for e in entries])
        attempt = len(records)
        evidence = relaunch.Evidence(
            log_text="".join(tail), procs=[p.__dict__ for p in read_registry(out)],
            start_records=read_start_records(out), events=_read_jsonl(out / "events.jsonl"),
            unanswered={h for h, n in aliases.items() if n is None},
            aliases={h: n for h, n in aliases.items() if n}, launcher_host=socket.gethostname(),
            ranks_per_replica=ranks_per_replica)
        lost_before = records[-1].lost_hosts if records else {}
        new = relaunch.lost_hosts([e.name for e in entries if e.name not in lost_before],
                                  evidence)
        lost = {**lost_before, **new}
        _end_old_job(agent, evidence, entries, out)
        last_step = max((s["step"] for s in _read_jsonl(out / "metrics.jsonl")),
                        default=(records[-1].resume_step if records else 0))
        hopeless = relaunch.ends_the_same_way(evidence.start_records,
                                              bool(_read_jsonl(out / "metrics.jsonl")), len(new))
        plan = relaunch.plan_relaunch(entries, lost, ranks_per_replica, args.replicas, per_host,
                                      relaunch.newest_complete_checkpoint(folder), len(records),
                                      rc.max_relaunches, hopeless)
        _keep_attempt(out, attempt, "".join(tail))
        if isinstance(plan, str):
            print(f"recover-hsdp: no relaunch: {plan}", file=sys.stderr, flush=True)
            break
        current = copy.copy(args)
        current.replicas = plan.replicas
        current.fault = []  # injected faults belong to the first attempt
        current.hostfile = str(_write_hostfile(out, attempt + 1, plan.hosts)) \
            if args.hostfile else None
        current.overrides = [*args.overrides]
        if plan.resume_step:
            current.overrides += ["--checkpoint.load_step", str(plan.resume_step)]
        elif plan.replicas != args.replicas:
            current.overrides += ["--training.global_batch_size", str(batch)]  # B unchanged
        cause = "; ".join(f"{h}: {why}" for h, why in new.items()) or \
            f"mpirun ended (exit code {returncode}) without a completed summary"
        record = relaunch.RelaunchRecord(
            attempt=attempt + 1, cause=cause, lost_hosts=lost,
            hosts=[e.name for e in plan.hosts], replicas=plan.replicas,
            resume_step=plan.resume_step, last_step=last_step,
            steps_lost=max(0, last_step - plan.resume_step),
            failure_at=relaunch.failure_time(evidence.events, ended_at, set(lost)),
            ended_at=ended_at, relaunched_at=time.time())
        try:
            command, _, _ = build_job(current)
        except ConfigError as err:
            print(f"recover-hsdp: no relaunch: {err}", file=sys.stderr, flush=True)
            break
        # the old job's claims stay: a cut-off part of it may still be alive and must find the
        # majority's claim there and stop ([Note: split brain] in collectives/arbiter.py)
        clear_run_files(out, keep=("membership",))
        records.append(record)
        print(f"recover-hsdp: relaunch {record.attempt}/{rc.max_relaunches}: {cause}; "
              f"{plan.replicas} replica(s) on {', '.join(record.hosts)} from step "
              f"{plan.resume_step} ({record.steps_lost} step(s) to redo)", flush=True)
    if records:
        _merge(out, records)
    return returncode


class RelaunchRequest:
    """The writer's word that an emergency checkpoint is complete ([Note: emergency checkpoint]
    in manager/manager.py): if a host of the job then does not answer the agent, PRRTE will end
    the job when it notices the lost daemon (``daemon_keepalive_s`` later), so the launcher ends
    it now and relaunches from that checkpoint, redoing no step. A host that answers (its ranks
    died, its daemon lives) leaves the in-job tier to carry on."""

    def __init__(self, out: Path, agent: list[str], hosts: list[str]) -> None:
        self.path, self.agent, self.hosts = out / RELAUNCH_REQUEST, agent, hosts
        self.verdict = out / RELAUNCH_VERDICT
        for path in (self.path, self.verdict):
            path.unlink(missing_ok=True)  # an earlier attempt's
        self._seen: float | None = None
        self.answers: dict[str, str | None] | None = None  # the hosts' answers that ended it

    def check(self) -> str | None:
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._seen:
                return None
            request = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        self._seen = mtime
        answers = remote.host_names(self.agent, self.hosts)
        silent = [h for h, name in answers.items() if name is None]
        if not silent:  # its ranks died, its daemon lives: the in-job tier carries on
            write_json_atomic(self.verdict, {"step": request["step"], "go_on": True})
            return None
        self.answers = answers
        return (f"host(s) {', '.join(silent)} lost (no answer) after step {request['step']}'s "
                "emergency checkpoint: ending the job to relaunch from it")


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
    path.write_text(relaunch.format_hostfile(entries))
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
