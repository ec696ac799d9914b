"""The relaunch tier: a job the MPI runtime could not keep becomes a new job from a checkpoint.

[Note: the relaunch tier] In-job repair (ULFM) survives what the runtime survives: process
deaths, frozen ranks, replica-local errors, a cut link until PRRTE notices. PRRTE 3.0 ends the
whole job when it loses a daemon (a host SIGKILLed or cut off; docs/ULFM_NOTES.md), and a death
before the fault-tolerant world exists (MPI_Init, the bootstrap all-gather, the replica's
rendezvous) ends it too. Those endings are "abnormal": mpirun returned and no summary.json with
``completed`` was written. The launcher then

1. finds the lost hosts (:func:`lost_hosts`): the hosts PRRTE names in its lost-daemon /
   failed-daemon message, the hosts that did not answer the launcher's probe, the hosts where
   every rank of the job was declared dead by the survivors (events.jsonl) and none was aborted
   by Open MPI as falsely accused (:func:`accused_hosts`), and, for a job
   that ended before its world was built, the hosts of ranks that died hard at start-up
   ([Note: start-up records]). mpirun's own host is never "lost" (the launcher runs there);
2. ends every process of the old job on every host that answers (procs.json and the start-up
   records, pid + start time, over the agent mpirun itself uses: ``recover_hsdp.cli.hosts``);
3. starts the job again (:func:`plan_relaunch`) on the hostfile's hosts minus the lost ones
   (hosts of the hostfile the job did not use are standby hosts), with as many replicas as
   fit (at most the original R), from the newest CERTIFIED restart point (a complete
   ``step-N`` folder whose certificate says it holds the full state: :func:`newest_restart_point`,
   [Note: certified checkpoints]), else from step 0, keeping B
   either way ([Note: the relaunch keeps B]);
   An attempt that ended before its first step because a live rank was declared dead (Open MPI
   aborts a rank "reported dead by someone else": :func:`false_detections`) lost no host
   through it: its hosts stay, and the next attempt gets twice the start-up margin
   (``slow_phase_s``: :func:`wider_margins`, one line says so; [Note: detection margins by
   phase] in groups/heartbeat.py); an attempt whose ranks crashed inside MPI_Init (Open MPI's
   start-up race: :func:`init_crashes`) is relaunched as it was; neither counts against
   ``max_relaunches`` (up to 3);
   injected ``--fault`` specs that fired stay with their attempt, the others go on
   (:func:`unfired_faults`);
4. at most ``recover.tiers.max_relaunches`` times; every relaunch is a record in events.jsonl
   (``phase: relaunch``) and in summary.json (``relaunches``): cause, lost hosts, steps lost,
   seconds from the failure to training again. The outputs of an attempt are kept in
   ``relaunch/attempt-<k>/`` and merged at the end (:func:`merge_steps`): every step appears
   once, the steps after the checkpoint that the old job had done are replaced by the new
   job's.

[Note: the relaunch keeps B] A relaunch onto fewer replicas than W_init keeps the in-job
contract: B = W_init x G_init microbatches every step, the policy's roles and quotas as the
in-job tier would set them for the survivors (majors with G raised, a minor where B does not
divide), never a refusal for divisibility. From a checkpoint the policy state is in it (B, G,
the stream cursors; the data go on from the loader state). Either way the relaunch passes
``recover.initial_replicas = W_init``: the ranks build the policy for W_init replicas of which
the launched R are alive (ids R .. W_init-1 start dead), G_init is
``training.global_batch_size`` over W_init, the stream slots are W_init's (a relaunch from step
0 reads what the in-job tier would after losing those replicas before step 1), and TorchTitan's
own batch check sees only one replica (``data_parallel_replicate_degree = 1``,
titan/trainer.py). The ids >= R are not refilled by a join ([Note: rejoin]); the next relaunch
onto more hosts refills them.

This module is the decision logic only (plain Python, tested in-process with fakes); the
launcher (``recover_hsdp.cli.launch``) does the I/O.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from recover_hsdp import certificates
from recover_hsdp.cli.hostfile import HostEntry

_DAEMON_HOST = (re.compile(r"Remote daemon:.*?on node\s+(\S+)"),  # lost communication with
                re.compile(r"Remote host:\s+(\S+)"))               # failed to report back


def newest_restart_point(folder: str | Path | None) -> int | None:
    """The step of the newest certified restart point under ``folder`` ([Note: certified
    checkpoints] in recover_hsdp/certificates.py: complete, certified, not model-only), or
    None. The trainer verifies it once loaded and falls back further if it does not."""
    return certificates.newest_restart_point(folder)


def node_loss_cost(checkpoints: bool, max_relaunches: int,
                   memory_interval: int = 0) -> str | None:
    """What a failure the job cannot survive in place will cost it, said once at start when it
    is more than the steps since the newest saved state: such a failure (a lost host, a death
    before the world is built: [Note: the relaunch tier]) ends the run, or relaunches it from
    step 0. None: there is host-memory state ([Note: host-memory state]) or checkpoints to
    relaunch from."""
    what = "a failure the job cannot survive in place (a lost host, a death before the world is built)"
    saved = checkpoints or memory_interval > 0
    if max_relaunches == 0:
        return (f"recover.tiers.max_relaunches = 0: {what} ends the run"
                + ("" if saved else "; with checkpoint.enable = false and "
                   "recover.tiers.memory_snapshot_interval = 0 nothing is saved to restart it "
                   "from"))
    if not saved:
        return (f"checkpoint.enable = false and recover.tiers.memory_snapshot_interval = 0: "
                f"{what} relaunches the run from step 0, every step done so far redone; "
                "recover.tiers.memory_snapshot_interval = N (host memory, no shared "
                "filesystem) or checkpoint.interval = N bounds that to N steps (0 after a cut "
                "link: the emergency boundary)")
    return None


def daemon_hosts(log_text: str) -> set[str]:
    """Host names in PRRTE's "lost communication with a remote daemon" / "daemon failed to
    report back" messages (the names the daemons gave, i.e. their host names)."""
    return {m.group(1) for pattern in _DAEMON_HOST for m in pattern.finditer(log_text)}


@dataclass
class Evidence:
    """What an attempt that ended abnormally left behind.

    Args:
        log_text: the tail of mpirun's output.
        procs: procs.json as (host, pid, start) dicts, world rank order ([] if not written).
        start_records: rank -> start-up record ([Note: start-up records]).
        events: events.jsonl of the attempt.
        unanswered: hostfile names that did not answer the launcher's probe.
        aliases: hostfile name -> the host name its processes report (from the probe).
        launcher_host: the host name of mpirun's host.
        ranks_per_replica: S.
    """

    log_text: str = ""
    procs: list[dict] = field(default_factory=list)
    start_records: dict[int, dict] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    unanswered: set[str] = field(default_factory=set)
    aliases: dict[str, str] = field(default_factory=dict)
    launcher_host: str = ""
    ranks_per_replica: int = 1
    false_detections: int = 0     # live ranks declared dead (:func:`false_detections`)
    init_crashes: int = 0         # ranks crashed in MPI_Init on a failure notice


def lost_hosts(hosts: list[str], ev: Evidence) -> dict[str, str]:
    """hostfile name -> why it is lost ([Note: the relaunch tier], step 1)."""
    name_of = {ev.aliases.get(h, h): h for h in hosts}  # reported host name -> hostfile name
    name_of.update({h: h for h in hosts})
    lost: dict[str, str] = {}

    def mark(reported: str, cause: str) -> None:
        host = name_of.get(reported)
        if host is not None and ev.aliases.get(host, host) != ev.launcher_host \
                and host != ev.launcher_host:
            lost.setdefault(host, cause)

    for host in ev.unanswered:
        mark(host, "did not answer the launcher's probe")
    for reported in sorted(daemon_hosts(ev.log_text)):
        mark(reported, "PRRTE lost its daemon")
    if ev.false_detections:  # the deaths were the detector's mistakes, not the hosts'
        return lost
    if ev.procs:
        dead = {r for e in ev.events for r in e.get("dead_replicas") or []}
        by_host: dict[str, set[int]] = {}
        for rank, proc in enumerate(ev.procs):
            by_host.setdefault(proc["host"], set()).add(rank // ev.ranks_per_replica)
        accused = accused_hosts(ev.log_text)
        for reported, replicas in sorted(by_host.items()):
            if replicas <= dead and reported not in accused:
                mark(reported, "every rank on it was declared dead")
    else:  # ended before the world was built: [Note: start-up records]
        seen = {r for record in ev.start_records.values() for r in record.get("saw_failed", ())}
        for rank, record in sorted(ev.start_records.items()):
            if "exited" not in record and (not seen or rank in seen):
                mark(record["host"], f"rank {rank} died during start-up")
    return lost


_FALSE_DETECTION = "I have been reported dead by someone else"  # Open MPI, then it aborts
_ACCUSED_HOST = re.compile(r"\[([^:\]\s]+):\d+\] \[\[\d+,\d+\],\d+\] ompi_proc_mark_as_failed: "
                           + _FALSE_DETECTION)


def accused_hosts(log_text: str) -> set[str]:
    """The hosts (as they name themselves) of live ranks Open MPI aborted because a detector
    had declared them dead: not evidence against the host."""
    return set(_ACCUSED_HOST.findall(log_text))


_INIT_CRASH = "(ompi_comm_revoke_local+"  # a failure notice inside MPI_Init: Open MPI crashes


def false_detections(log_text: str, progressed: bool) -> int:
    """Live ranks Open MPI aborted because a detector declared them dead, in an attempt that
    ended before its first step (``progressed`` False); 0 once a step was committed (the
    in-job tier then treated them as ordinary deaths)."""
    return 0 if progressed else log_text.count(_FALSE_DETECTION)


def init_crashes(log_text: str, progressed: bool) -> int:
    """Ranks that crashed handling a failure notice inside MPI_Init (Open MPI revokes a
    communicator that does not exist yet), in an attempt that made no step. Seen as Open MPI's
    start-up crash (docs/ULFM_NOTES.md "The detector at start-up"): one rank jumps to a NULL
    pointer ("Failing at address: (nil)"), every other rank crashes on its failure notice;
    the cause, from the source and a live rank's stacks (gdb, 2026-12-07: the detector thread
    in ``ompi_comm_start_detector`` sending while the main thread is still in
    ``ompi_comm_failure_detector_init``), is a rank's detector thread sending its first
    heartbeat from inside MPI_Init to an observer that has not yet registered the receiver.
    No margin changes it; a rank left waiting inside MPI_Init ends at its deadline ([Note: a
    bounded MPI_Init] in train.py), so the attempt does end."""
    return 0 if progressed else log_text.count(_INIT_CRASH)


def margin_overrides(detect_s: float, slow_phase_s: float) -> list[str]:
    """The command-line overrides that give an attempt these detection margins."""
    return ["--recover.timeouts.detect_s", f"{detect_s:g}",
            "--recover.timeouts.slow_phase_s", f"{slow_phase_s:g}"]


def wider_margins(detect_s: float, slow_phase_s: float, found: int,
                  crashed: int = 0) -> tuple[list[str], str]:
    """The next attempt's overrides after ``found`` false detections or ``crashed`` ranks in
    MPI_Init (:func:`init_crashes`) before the first step, and the one line the launcher
    prints. Before its first step a rank is in its start-up phase, under ``slow_phase_s`` for
    both signals ([Note: detection margins by phase]): a false detection doubles that margin
    and leaves ``detect_s``, the steady-state bound, as it is. A crash inside MPI_Init is
    relaunched with the margins unchanged (no margin reaches it)."""
    if not (found or crashed) or detect_s <= 0:
        return [], ""
    slow = max(slow_phase_s, detect_s)
    if not found:
        return (margin_overrides(detect_s, slow),
                f"recover-hsdp: {crashed} rank(s) crashed on a failure notice inside MPI_Init "
                "(Open MPI's start-up race, not a lost host): relaunched with the same margins")
    return (margin_overrides(detect_s, 2 * slow),
            f"recover-hsdp: {found} live rank(s) were declared dead before the first step (a "
            "detection, not a lost host): the relaunch widens the start-up margin "
            f"recover.timeouts.slow_phase_s {slow_phase_s:g} -> {2 * slow:g} s (detect_s "
            f"{detect_s:g} s, the steady-state bound, unchanged)")


def ends_the_same_way(start_records: dict[int, dict], progressed: bool,
                      newly_lost: int) -> str | None:
    """Why a relaunch would end the same way, or None: the attempt committed no step, lost no
    host, and a rank left through a configuration error (exit code 2, one line on stderr):
    the relaunch keeps the hosts and the configuration, so that rank refuses again, whatever
    the others did (mpirun may end them before their own line). Anything else before the first
    step (a crash inside MPI_Init, a start-up death) may be transient: relaunched, within
    ``max_relaunches``."""
    reasons = [r.get("exited", "") for r in start_records.values()]
    if progressed or newly_lost or not any(r.startswith("SystemExit: 2") for r in reasons):
        return None
    return ("a rank stopped on a configuration error before the first step (see the log "
            "above): not relaunched")


def replicas_that_fit(entries: list[HostEntry], ranks_per_replica: int, wanted: int,
                      ranks_per_host: int | None) -> int:
    """Replicas (of S ranks) that ``entries`` hold: ``ranks_per_host`` ranks on each host
    (a ``--map-by ppr:K:node`` or GPU layout), else each host's ``slots`` (unset: as many as
    asked, mpirun oversubscribes CPU hosts); at most ``wanted``."""
    ranks = sum(ranks_per_host if ranks_per_host else (e.slots or wanted * ranks_per_replica)
                for e in entries)
    return min(wanted, ranks // ranks_per_replica)


@dataclass
class Plan:
    """What the next attempt runs: on which hosts, how many replicas, from which step."""

    hosts: list[HostEntry]
    replicas: int
    resume_step: int  # 0: from scratch
    from_memory: bool = False  # the survivors' host-memory generation, not a DCP checkpoint


def plan_relaunch(entries: list[HostEntry], lost: dict[str, str], ranks_per_replica: int,
                  replicas: int, ranks_per_host: int | None, checkpoint_step: int | None,
                  relaunches_done: int, max_relaunches: int,
                  hopeless: str | None = None, memory_step: int | None = None) -> Plan | str:
    """The next attempt ([Note: the relaunch tier], step 3), or why there is none (one line).
    ``hopeless``: :func:`ends_the_same_way`'s reason, if any. ``memory_step``: the newest
    host-memory generation complete on the surviving hosts ([Note: host-memory state] in
    recovery/host_state.py): preferred to a DCP checkpoint of the same step or older (it is
    read from local memory, no shared filesystem)."""
    if relaunches_done >= max_relaunches:
        return (f"the job ended abnormally and recover.tiers.max_relaunches={max_relaunches} "
                "relaunch(es) are used up")
    if hopeless:
        return hopeless
    left = [e for e in entries if e.name not in lost]
    fit = replicas_that_fit(left, ranks_per_replica, replicas, ranks_per_host)
    if fit < 1:
        return (f"no host left for a replica of {ranks_per_replica} rank(s) (lost: "
                f"{', '.join(sorted(lost)) or 'none'})")
    if memory_step and memory_step >= (checkpoint_step or 0):
        return Plan(left, fit, memory_step, from_memory=True)
    return Plan(left, fit, checkpoint_step or 0)


def unfired_faults(specs: list[str], fired: list[dict]) -> list[str]:
    """The launcher's ``--fault`` specs that no attempt fired (``faults_fired.jsonl`` rows): an
    injected fault fires once per run, so a relaunch keeps those its predecessors never
    reached (e.g. after an attempt lost at start-up) and drops those that fired."""
    from recover_hsdp.faults import FaultSpec

    done = {(f["replica"], f["step"], f["phase"], f["mode"]) for f in fired}
    out = []
    for text in specs:
        spec = FaultSpec.parse(text)
        if (spec.replica, spec.step, spec.phase.value, spec.mode.value) not in done:
            out.append(text)
    return out


def ranks_per_host_of(mpi_args: list[str], gpus_per_node: int, ranks_per_gpu: int) -> int | None:
    """Ranks mpirun puts on each host: ``--map-by ppr:K:node`` in the mpirun arguments, else
    the GPU layout's G x K, else None (the hostfile's slots decide)."""
    for index, arg in enumerate(mpi_args):
        value = arg.split("=", 1)[1] if arg.startswith("--map-by=") else (
            mpi_args[index + 1] if arg == "--map-by" and index + 1 < len(mpi_args) else None)
        m = re.match(r"ppr:(\d+):node", value or "")
        if m:
            return int(m.group(1))
    return gpus_per_node * ranks_per_gpu if gpus_per_node else None


@dataclass
class RelaunchRecord:
    """One relaunch, as events.jsonl (``phase: relaunch``) and summary.json record it."""

    attempt: int                  # the attempt that starts (1 = the first relaunch)
    cause: str
    lost_hosts: dict[str, str]
    hosts: list[str]
    replicas: int
    resume_step: int
    last_step: int                # the last step the ended attempt committed
    steps_lost: int               # committed steps redone: last_step - resume_step
    failure_at: float             # wall clock: first sign of the failure (detection or end)
    ended_at: float               # mpirun of the ended attempt returned
    relaunched_at: float          # the new mpirun started
    detect_s: float | None = None  # the new attempt's wider margin (:func:`wider_margins`)
    slow_phase_s: float | None = None
    false_detection: bool = False  # relaunched for false detections at start-up (its hosts kept)
    from_memory: bool = False     # resumed from the survivors' host memory, not DCP
    training_again_at: float | None = None  # the new attempt committed its first step
    failure_to_training_s: float | None = None

    def event(self) -> dict:
        return {"phase": "relaunch", "step": self.resume_step, "epoch": None, **asdict(self)}


def failure_time(events: list[dict], ended_at: float, lost: set[str]) -> float:
    """When the failure was first seen: the survivors' earliest detection of a death in the
    ended attempt (``decided_at - detect_s``) when there is one, else mpirun's end."""
    seen = [e["decided_at"] - e.get("detect_s", 0.0) for e in events
            if e.get("dead_replicas") and "decided_at" in e]
    return min([*seen, ended_at]) if lost or seen else ended_at


def merge_steps(attempts: list[list[dict]], resumes: list[int], key: str = "step",
                offset: int = 0) -> list[dict]:
    """One record per step across attempts: attempt k's records up to ``resumes[k]`` (the step
    the next attempt resumed from; the later steps it had done are redone), a later attempt's
    record replacing an earlier one of the same step. ``offset``: 1 for the ledger (its
    ``step`` is the 0-based iteration)."""
    merged: dict[int, dict] = {}
    for index, records in enumerate(attempts):
        merged.update({r[key]: r for r in records})
        if index < len(resumes):
            merged = {k: r for k, r in merged.items() if k + offset <= resumes[index]}
    return [merged[k] for k in sorted(merged)]
