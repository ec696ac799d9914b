"""``FailureLog``: a replica-local error turned into a death, and the record of every repair.

[Note: replica-local errors] An error inside a replica (forward, backward, the all-reduce hook,
the optimizer; an OOM; a gloo error because a peer of the replica died) is turned into the
death of this rank, like the hang watchdog turns a hang into one: a replica lives or dies as a
unit, and a death is what every layer already handles. Its peers in the replica learn of it
in one of three ways, and each ends them within seconds ([Note: a replica leaves as a unit] in
groups/replica_group.py): their intra-replica collective fails at once when the dead
process's sockets close (gloo, a process that really died); the MPI world reports the rank
failed or the consensus excludes the replica; or their replica heartbeat finds it silent for
``detect_timeout_s`` (a frozen process or a cut link keeps gloo waiting until its timeout,
and a NCCL kernel spins on a dead peer: neither fails "at once"). Then they take this path or
retire at the consensus, and the other replicas go on as after any death; nothing they wait
for is left alive. Before dying the rank writes its reason to ``errors/`` in the output folder
(and stderr); the writer puts it in events.jsonl with the repair that followed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from recover_hsdp import status
from recover_hsdp.collectives.guard import die as kill_self
from recover_hsdp.groups.replica_group import leave_replica
from recover_hsdp.outputs import RunMetrics, write_reason
from recover_hsdp.workload import DataAssignment, WorkloadPolicy


class FailureLog:
    """Args:
        world: the ``World`` (collectives/interface.py).
        outputs: this rank's ``RunMetrics`` (events are written by the writer only).
        out_dir: the run's output folder (``errors/``).
        die: ends this rank (default: SIGKILL itself, ``collectives.guard.die``, after
            flushing; tests pass the fake world's kill).
    """

    def __init__(self, world, outputs: RunMetrics, out_dir: str | Path,
                 die: Callable[[], None] | None = None):
        self.world, self.outputs, self.out_dir = world, outputs, Path(out_dir)
        self._end: Callable[[str], None] = (lambda message: die()) if die else kill_self

    def leave(self, step: int, reason: str) -> NoReturn:
        """[Note: replica-local errors]: this rank leaves its replica (``leave_replica``, the
        one way out: the reason to ``errors/``, then the end of this rank)."""
        leave_replica(self.out_dir, self.world, step, reason,
                      headline="error inside the replica", end=self._end)

    def hung(self, reason: str, latest: dict[str, Any] | None) -> None:
        """[Note: rank status] (recover_hsdp/status.py): this rank's watchdog is about to end
        it (on the watchdog thread): where the main thread was goes to ``errors/``."""
        where = status.describe(latest) if latest else "before its first phase point"
        write_reason(self.out_dir, {
            "step": latest["step"] if latest else 0, "replica": self.world.replica,
            "shard": self.world.shard, "rank": self.world.world_rank,
            "reason": f"hung at {where}: {reason}", "phase": latest and latest["phase"],
            "stack": status.main_thread_stack(), "time": time.time()})

    def last_seen(self, replicas) -> dict[str, dict[str, Any]]:
        """The last status record of every rank of ``replicas`` ([Note: rank status])."""
        return {str(rank): record for rank, record in status.read_all(self.out_dir).items()
                if record.get("replica") in replicas}

    def reasons(self, replicas) -> dict[str, list[str]]:
        """Reasons the ranks of ``replicas`` wrote before leaving."""
        found: dict[str, list[str]] = {}
        for path in sorted((self.out_dir / "errors").glob("rank*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record["replica"] in replicas:
                found.setdefault(str(record["replica"]), []).append(
                    f"rank {record['rank']} step {record['step']}: {record['reason']}")
        return found

    def log_repair(self, step: int, result, policy: WorkloadPolicy, **detail: Any) -> None:
        """The event of one repair (``result``: the unclean ``ConsensusResult``)."""
        dead = result.dead_replicas
        self.outputs.log_event({
            "step": step, "epoch": result.epoch, **detail, "dead_replicas": sorted(dead),
            "alive_replicas": list(result.alive_replicas), "detect_s": result.detect_s,
            "repair_s": result.repair_s, "repair_rounds": result.rounds,
            "errors": self.reasons(dead), "last_seen": self.last_seen(dead) if dead else {},
            **unread_streams(policy, dead)})


def unread_streams(policy: WorkloadPolicy, dead) -> dict[str, Any]:
    """[Note: stream slots] the stream slots of ``dead`` replicas stop at their cursor: the
    record of what is left unread (stream mode; nothing in exact mode)."""
    if policy.data_assignment is not DataAssignment.STREAM:
        return {}
    slots = {policy.slot_of(r) for r in dead}
    unread = policy.orphaned_slots(dead)
    return {"unread_streams": {str(s): unread[s] for s in sorted(slots)}}
