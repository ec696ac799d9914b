"""``FailureLog``: a replica-local error turned into a death, and the record of every repair.

[Note: replica-local errors] An error inside a replica (forward, backward, the all-reduce hook,
the optimizer; an OOM; a gloo error because a peer of the replica died) is turned into the
death of this rank, like the hang watchdog turns a hang into one: a replica lives or dies as a
unit, and a death is what every layer already handles. Its peers in the replica learn of it
in one of three ways, and each ends them within seconds ([Note: a replica leaves as a unit] in
manager/replica_group.py): their intra-replica collective fails at once when the dead
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
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from recover_hsdp.outputs import RunMetrics
from recover_hsdp.workload import DataAssignment, WorkloadPolicy


class FailureLog:
    """Args:
        world: the fault-tolerant world (``replica``, ``shard``, ``world_rank``).
        outputs: this rank's ``RunMetrics`` (events are written by the writer only).
        out_dir: the run's output folder (``errors/``).
        die: ends this rank (default: SIGKILL itself, :func:`exit_now`; tests pass the fake
            world's kill).
    """

    def __init__(self, world, outputs: RunMetrics, out_dir: str | Path,
                 die: Callable[[], None] | None = None):
        self.world, self.outputs, self.out_dir = world, outputs, Path(out_dir)
        self.die = die or exit_now

    def leave(self, step: int, reason: str) -> NoReturn:
        """[Note: replica-local errors]: write the reason, then end this rank."""
        world = self.world
        record = {"step": step, "replica": world.replica, "shard": world.shard,
                  "rank": world.world_rank, "reason": reason, "time": time.time()}
        print(f"[recover-hsdp] replica {world.replica} shard {world.shard}: error inside the "
              f"replica at step {step}, this rank leaves: {reason}", flush=True)
        write_reason(self.out_dir, record)
        self.die()
        raise AssertionError("die() returned")

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
            "errors": self.reasons(dead), **unread_streams(policy, dead)})


def _reason_path(out_dir: str | Path, world_rank: int) -> Path:
    return Path(out_dir) / "errors" / f"rank{world_rank}.json"


def write_reason(out_dir: str | Path, record: dict[str, Any]) -> None:
    """``errors/rank<N>.json`` in ``out_dir``: why rank N left (safe from any thread)."""
    try:
        path = _reason_path(out_dir, record["rank"])
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        pass  # the reason is on stderr


def forget_reasons(out_dir: str | Path, world_ranks) -> None:
    """Joined newcomers: an earlier life's reason for leaving is not theirs."""
    for world_rank in world_ranks:
        _reason_path(out_dir, world_rank).unlink(missing_ok=True)


def unread_streams(policy: WorkloadPolicy, dead) -> dict[str, Any]:
    """[Note: stream slots] the stream slots of ``dead`` replicas stop at their cursor: the
    record of what is left unread (stream mode; nothing in exact mode)."""
    if policy.data_assignment is not DataAssignment.STREAM:
        return {}
    slots = {policy.slot_of(r) for r in dead}
    unread = policy.orphaned_slots(dead)
    return {"unread_streams": {str(s): unread[s] for s in sorted(slots)}}


def exit_now() -> None:
    """A replica-local error ends the process ([Note: replica-local errors]) by SIGKILL, no
    MPI_Finalize: mpirun (PRRTE 3.0) tolerates any number of ranks killed by a signal, but ends
    the job at the second rank that exits with a non-zero status (measured: survivors orphaned)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
