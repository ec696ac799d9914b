"""Replica rejoin at a step boundary (RecoverManager's): replacements come back, G goes down.

[Note: rejoin at a boundary] Before a step, every survivor decides the same thing from agreed
facts only: the replicas missing (W_init minus the alive ones), how many steps ago one was last
lost (``[recover.tiers] respawn_after_steps``), and the operator's join requests counted by the
writer; the counts ride along in every step's totals reduce (no extra collective). When a join is due:

  1. start: the spawner (shard 0 of the lowest alive replica: the writer) spawns S ranks per
     missing replica (the replica ids of dead ones; ``MPI_Comm_spawn`` blocks only the spawner,
     only until they initialised MPI); every survivor records the join (ids, spawner, step)
     and goes on training while the newcomers build their trainer; the spawner tests, at every
     step, the barrier the newcomers enter once ready, and the totals reduce agrees on it;
  2. at the first boundary after the spawner saw them ready, an attempt ([Note: rejoin] in
     recover_hsdp/collectives/join.py: port, accept, offer, state, grow) with the world as it is
     then: the donor (the lowest alive replica that is not the spawner's, so that its death
     leaves the newcomers' link; rank s for shard s) sends each newcomer rank s its state:
     parameters and optimizer state (this rank's local shards, in a fixed order), LR
     schedulers, tokens seen, the policy, the run's metrics / ledger history, process table
     and respawn clock; the newcomer checks the exact fingerprint of its parameters against the
     donor's ([Note: exact fingerprints] in recovery/fingerprint.py);
  3. one agreement: all ok, or the attempt failed (survivors go on with their old world; a
     survivor that died is found by the next step as any death). The started newcomers are
     kept: they go back to their spawner, the next boundary tries again (a new donor if the
     donor died), at most ``JOIN_ATTEMPTS`` times;
  4. the world grows (new epoch, alive replicas + newcomers); the policy admits them, so G
     goes back toward G_init with B unchanged (``WorkloadPolicy.admit``).
The survivors stall only for 2-4 (and the spawner for the spawn call of 1), not for the
newcomers' start-up. A survivor's death while the newcomers start or between attempts keeps
the join (the ids they take are still missing: only a join brings a replica back, one at a
time); what gives it up: the spawner's death (the newcomers see it and exit), a newcomer's
death (the spawner's check after the attempt, or its test before they were ready), newcomers
not ready within ``repair_s``, ``JOIN_ATTEMPTS`` failed attempts, the end of the run. The next
join is then ``respawn_after_steps`` after the start of this one (or at the next request).
A survivor's join is a ``JoinState`` (join_state.py): IDLE -> STARTING (1) -> READY -> JOINING
(2-4) -> IDLE, or STARTING again after a failed attempt; LOST gives it up.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from recover_hsdp.collectives.processes import ProcessInfo
from recover_hsdp.manager.join_state import (JOIN_ATTEMPTS, JoinState, StartedJoin,
                                             finish_requests, join_requests)
from recover_hsdp.manager.joins import CollectiveJoins, Joins
from recover_hsdp.manager.local_processes import LocalProcesses
from recover_hsdp.manager.phases import PhaseHooks
from recover_hsdp.manager.work import JoinWork
from recover_hsdp.manager.writer import WriterDuties
from recover_hsdp.outputs import RunMetrics, forget_reasons
from recover_hsdp.phases import Phase
from recover_hsdp.workload import WorkloadPolicy


class Rejoin:
    """This rank's part in [Note: rejoin at a boundary], as a survivor or as a newcomer.

    Args:
        world, writer, outputs, processes, phases: the manager's (the world grows; the writer
            duty may pass to a newcomer; the process table takes the newcomers).
        out_dir: the run's output folder (``join/requests``).
        checksum: this rank's parameter fingerprint (the newcomer checks it against the donor's),
            or None.
        respawn_after_steps: ``[recover.tiers] respawn_after_steps`` (0: only on request).
        joins: the join's collective operations (``Joins``; default: ``CollectiveJoins``).

    Attributes:
        state: this survivor's join (``JoinState``; IDLE on a newcomer).
    """

    def __init__(self, *, world, writer: WriterDuties, outputs: RunMetrics,
                 processes: LocalProcesses, phases: PhaseHooks, out_dir: str | Path,
                 checksum: Callable[[], int] | None = None, respawn_after_steps: int = 0,
                 joins: Joins | None = None):
        self.world, self.writer, self.outputs = world, writer, outputs
        self.processes, self.phases, self.out_dir = processes, phases, Path(out_dir)
        self.checksum = checksum
        self.respawn_after_steps = respawn_after_steps
        self.joins: Joins = joins if joins is not None else CollectiveJoins()
        self.requests_seen = 0       # agreed in the last committed step's totals
        self._lost_since: int | None = None
        self._alive_before: int | None = None
        self.state = JoinState.IDLE
        self._join: StartedJoin | None = None  # None exactly when IDLE

    def _move(self, state: JoinState, join: StartedJoin | None = None) -> None:
        """The one place the join's state changes (``join``: the join a start records)."""
        assert self.state.may_become(state), f"join: {self.state.name} -> {state.name}"
        self.state = state
        if state is JoinState.IDLE:
            self._join = None
        elif join is not None:
            self._join = join

    # ---------------------------------------------------------------- survivors

    def totals(self) -> tuple[float, float, float]:
        """This rank's share of the step's totals: (join requests seen by the writer,
        newcomers ready as the spawner sees them, newcomers lost as the spawner sees them)."""
        requests = len(join_requests(self.out_dir)) if self.writer.is_writer else 0
        join = self._join
        ready, failed = (join.spawner_sees(self.world.deadlines.repair_s) if join is not None
                         else (False, False))
        return float(requests), float(ready), float(failed)

    def agree_totals(self, requests: float, ready: float, failed: float) -> None:
        """The committed step's sums of :meth:`totals` (identical on every rank)."""
        self.requests_seen = int(requests)
        if self.state is not JoinState.IDLE:
            self._move(JoinState.LOST if failed > 0 else
                       JoinState.READY if ready > 0 else JoinState.STARTING)

    def maybe_admit(self, step: int, work: JoinWork, policy: WorkloadPolicy) -> None:
        """Survivors, before ``step``: start replacements when a join is due, try to complete
        a started join once the spawner saw them ready."""
        alive = self.world.alive_replicas
        lost = self._alive_before is not None and len(alive) < self._alive_before
        self._alive_before = len(alive)
        if lost:
            self._lost_since = step
        if self.state is not JoinState.IDLE:
            s = self.world.layout.ranks_per_replica
            if self._join.spawner // s not in alive:  # the newcomers' only link
                self._give_up(step, "the spawner died: the newcomers' link is lost")
            elif self.state is JoinState.LOST:
                self._give_up(step, "the newcomers died or never got ready")
            elif self.state is JoinState.READY:
                self._attempt(step, work, policy)
            return
        # the world's own ids only: a run launched below W_init ([Note: the relaunch keeps B]
        # in cli/relaunch.py) has no place for ids >= R; the relaunch tier refills those
        if len(alive) >= self.world.layout.num_replicas:  # no id missing (alive are ids < R)
            if self.requests_seen and self.writer.is_writer:  # nothing to bring back
                finish_requests(join_requests(self.out_dir), False)
            return
        due_respawn = (self.respawn_after_steps > 0 and self._lost_since is not None
                       and step - self._lost_since >= self.respawn_after_steps)
        if not due_respawn and not self.requests_seen:
            return  # every step until then: O(1) ([Note: a plan in O(1) per step])
        present = set(alive)
        missing = [r for r in range(self.world.layout.num_replicas) if r not in present]
        if not due_respawn:
            missing = missing[:self.requests_seen]
        self._lost_since = step  # the next attempt, if this one fails, N steps later
        self._start(step, work, missing)

    def abandon(self, step: int) -> None:
        """The run ends with newcomers still starting: they are told to exit."""
        if self.state is not JoinState.IDLE:
            self._give_up(step, "the run ended before the newcomers joined")

    def _start(self, step: int, work: JoinWork, replicas: list[int]) -> None:
        """The spawner (shard 0 of the lowest alive replica: the writer) starts the newcomers;
        every survivor records the join."""
        started = time.perf_counter()
        world = self.world
        spawner = world.alive_replicas[0] * world.layout.ranks_per_replica  # sorted
        join = StartedJoin(tuple(replicas), spawner, step)
        if world.world_rank == spawner:
            requests = join_requests(self.out_dir)[:len(replicas)]
            host = json.loads(requests[0].read_text()).get("host") if requests else None
            command, args = work.spawn_command(replicas)
            join.pending = self.joins.spawn(world, command, args, tuple(replicas),
                                            host=host or None)
            join.failed_here = join.pending is None
            join.requests = requests
        self._move(JoinState.STARTING, join)
        join.record = {"phase": "join", "step_started": step, "requested_replicas": replicas,
                       "spawner_rank": spawner, "spawn_stall_s": time.perf_counter() - started}

    def _give_up(self, step: int, reason: str) -> None:
        join = self._join
        self._move(JoinState.IDLE)
        if join.pending is not None:
            join.pending.abort(tell=not join.failed_here)
        finish_requests(join.requests, False)
        self._log({**join.record, "step": step, "ok": False, "reason": reason,
                   "attempts": join.attempts, "joined_replicas": [], "epoch": self.world.epoch,
                   "alive_replicas": list(self.world.alive_replicas), "join_stall_s": 0.0})

    def _attempt(self, step: int, work: JoinWork, policy: WorkloadPolicy) -> None:
        """Stages 2-4 on a survivor: the port, accept + merge, offer, state (the donor), agree,
        grow. A failed attempt keeps the join for the next boundary (bounded)."""
        world, join = self.world, self._join
        join.attempts += 1
        self._move(JoinState.JOINING)
        started = time.perf_counter()
        record = {**join.record, "step": step, "attempt": join.attempts, "joined_replicas": [],
                  "epoch_before": world.epoch}
        if join.pending is not None:
            record["start_to_ready_s"] = ((join.pending.ready_at or time.monotonic())
                                          - join.pending.started)
        assert not set(join.replicas) & set(world.alive_replicas), "a join takes missing ids only"
        link_ok = join.pending.offer_port() if join.pending is not None else True
        go = self.joins.agree(world, link_ok)
        channel = self.joins.accept(world, join.pending, join.spawner) if go else None
        ok = channel is not None and self._transfer_and_grow(channel, step, work, policy, record)
        self._settle(join, ok, link_ok, go)
        record.update(ok=ok, epoch=world.epoch, alive_replicas=list(world.alive_replicas),
                      join_stall_s=time.perf_counter() - started)
        if ok:
            record["joined_replicas"] = list(join.replicas)
        else:
            record["reason"] = ("a survivor died before the accept" if not go
                                else "a process died during the join")
        self._log(record)  # by the writer before the join, which may hand its duty over
        if ok:
            self._joined(channel, list(join.replicas), policy)
        elif join.attempts >= JOIN_ATTEMPTS:
            self._give_up(step, f"{JOIN_ATTEMPTS} attempts failed")

    def _transfer_and_grow(self, channel, step: int, work: JoinWork, policy: WorkloadPolicy,
                           record: dict[str, Any]) -> bool:
        """Stages 2 (the offer), 3 (the donor's state, one agreement) and 4 (grow) over the
        attempt's channel; False (the channel aborted) when any of them failed."""
        world, join = self.world, self._join
        replicas = list(join.replicas)
        donor = _donor(world.alive_replicas, join.spawner // world.layout.ranks_per_replica)
        offer = self.joins.offer(
            world.epoch, world.alive_replicas, tuple(replicas), world.layout.ranks_per_replica,
            world.layout.num_replicas, donor,
            {"step": step, "arbiter": world.arbiter_dir, "step_started": join.step_started,
             "lost_since": self._lost_since})  # the newcomers' respawn clock
        moved = work.join_nbytes()  # the same on every replica; nothing staged for it
        record.update(donor=donor, bytes_per_donor_rank=moved)
        ok = channel.exchange(offer, world.world_rank, ProcessInfo.current()) is not None
        sending = time.perf_counter()
        if ok and world.replica == donor:
            ok = self._send_state(channel, work, replicas, policy)
        ok = channel.agree(ok)
        # the donor's copy, as every survivor waits for it (the writer is rarely the donor)
        transfer_s = time.perf_counter() - sending
        record.update(transfer_s=transfer_s,
                      transfer_mb_per_s=moved / 1e6 / transfer_s if transfer_s else None)
        if ok:
            ok = world.grow(channel.merged, channel.ranks,
                            tuple(world.alive_replicas) + tuple(replicas),
                            world.layout.num_replicas, world.epoch)
        if not ok:
            channel.abort()
        return ok

    def _settle(self, join: StartedJoin, ok: bool, link_ok: bool, go: bool) -> None:
        """After an attempt: joined (IDLE), or STARTING; the spawner's news in the next totals."""
        pending = join.pending
        if ok:
            self._move(JoinState.IDLE)
            finish_requests(join.requests, True)
            if pending is not None:
                pending.close()
            return
        self._move(JoinState.STARTING)
        if pending is not None and not link_ok:
            join.failed_here = True  # a newcomer died
        elif pending is not None and go:  # the newcomers are back on the link: all there?
            join.failed_here = not pending.check()

    def _send_state(self, channel, work: JoinWork, replicas, policy: WorkloadPolicy) -> bool:
        # copying a model's whole state is long work without beats; its sends keep deadlines
        with self.world.watchdog_paused():
            return self._send_state_unwatched(channel, work, replicas, policy)

    def _send_state_unwatched(self, channel, work: JoinWork, replicas,
                              policy: WorkloadPolicy) -> bool:
        meta = {"work": work.join_meta(), "policy": policy.state_dict(),
                "ledger": self.writer.ledger_records, "steps": self.outputs.steps,
                "events": self.outputs.events, "procs": self.processes.table,
                "checksum": self._checksum()}
        buffers = work.join_tensors()
        flat = np.concatenate([b.reshape(-1).view(np.uint8) for b in buffers]) if buffers \
            else np.zeros(0, np.uint8)
        ok = True
        s = self.world.layout.ranks_per_replica
        for r in replicas:
            peer = r * s + self.world.shard
            ok = ok and channel.send(meta, peer)
            # phase=join, step=N: mid-transfer of the join started before step N (tests)
            self.phases.point(self._join.step_started, Phase.JOIN)
            ok = ok and channel.send_bytes(flat, peer)
        return ok

    def _checksum(self) -> int | None:
        return None if self.checksum is None else self.checksum()

    def _joined(self, channel, replicas, policy: WorkloadPolicy) -> None:
        """After the world grew: the process table, the policy and the writer duty take the
        newcomers."""
        self.processes.place(channel.ranks, channel.processes)
        policy.admit(replicas)
        self._alive_before = len(self.world.alive_replicas)
        self.writer.refresh()
        if self.writer.is_writer:
            self.processes.write_registry(self.out_dir)
            forget_reasons(self.out_dir, channel.ranks)

    def _log(self, record: dict[str, Any]) -> None:
        self.outputs.log_event(record)
        outcome = (f"replicas {record['joined_replicas']} joined" if record["ok"]
                   else f"aborted ({record.get('reason', 'a process died during it')})")
        print(f"[recover-hsdp] rank {self.world.world_rank}: join before step {record['step']}: "
              f"{outcome}; survivors stalled {record['join_stall_s']:.2f}s here, alive "
              f"{record['alive_replicas']}", flush=True)

    # ---------------------------------------------------------------- newcomers

    def join_as_newcomer(self, work: JoinWork) -> tuple[int, WorkloadPolicy]:
        """A spawned rank: stages 1-4 from the other side. Returns the step the survivors are
        about to run and the policy they run it with; exits the process when the join is
        aborted."""
        world = self.world
        started = time.perf_counter()
        channel, offer, meta = self._meet_survivors(work)
        policy = WorkloadPolicy.from_state_dict(meta["policy"])
        self._lost_since = offer.payload.get("lost_since")  # agreed, as on the survivors
        self.writer.ledger_records[:] = meta["ledger"]
        self.processes.table[:] = meta["procs"]
        self.outputs.steps, self.outputs.events = list(meta["steps"]), list(meta["events"])
        self._joined(channel, list(offer.new_replicas), policy)
        # Kept after _joined: a newcomer that takes the writer duty back-fills events.jsonl
        # there, while the old writer may still be appending its own, fuller record of this join
        # (it logs after the grow too): back-filled, this one would race it into a second line.
        self.outputs.events.append({  # the survivors' record of this join has the same key
            "phase": "join", "step": int(offer.payload["step"]), "epoch": world.epoch,
            "ok": True, "joined_replicas": list(offer.new_replicas),
            "alive_replicas": list(world.alive_replicas)})
        print(f"[recover-hsdp] newcomer rank {world.world_rank} (replica {world.replica}): "
              f"joined at step {offer.payload['step']} in {time.perf_counter() - started:.2f}s",
              flush=True)
        return int(offer.payload["step"]), policy

    def _meet_survivors(self, work: JoinWork):
        """The newcomer's attempts: (the channel, the offer, the donor's meta) of the one that
        grew the world; ends the process when none did."""
        world = self.world
        link = self.joins.parent_link(world)
        for attempt in range(1, JOIN_ATTEMPTS + 1):  # the survivors give up after as many
            channel = link.next_channel() if link is not None else None
            if channel is None:  # told to exit, or the spawner is lost
                break
            offer = channel.exchange(None, None, ProcessInfo.current())
            meta = self._receive_state(channel, offer, work) if offer is not None else None
            joined = channel.agree(meta is not None)
            if joined:
                joined = world.grow(channel.merged, channel.ranks,
                                    tuple(offer.alive_replicas) + tuple(offer.new_replicas),
                                    offer.num_replicas, offer.epoch)
            if joined:
                return channel, offer, meta
            channel.abort()
            print(f"[recover-hsdp] newcomer rank {world.world_rank}: join attempt {attempt} "
                  "failed; waiting for the next", flush=True)
            if not link.check():  # another newcomer died (or the spawner)
                break
        print(f"[recover-hsdp] newcomer rank {world.world_rank}: join aborted; exiting",
              flush=True)
        world.close()
        self.joins.exit_newcomer()
        raise AssertionError("exit_newcomer returned")  # it ends the process (the fake raises)

    def _receive_state(self, channel, offer, work: JoinWork) -> dict[str, Any] | None:
        """The donor's state into this rank's tensors; None if it did not arrive whole or the
        parameters differ from the donor's."""
        with self.world.watchdog_paused():  # as for the donor's copy (_send_state)
            return self._receive_state_unwatched(channel, offer, work)

    def _receive_state_unwatched(self, channel, offer, work: JoinWork) -> dict[str, Any] | None:
        world = self.world
        assert channel.ranks[channel.merged.Get_rank()] == world.world_rank, \
            "join offer: wrong replica id"
        world.adopt(offer)
        donor_rank = offer.donor * offer.ranks_per_replica + world.shard
        meta = channel.recv(donor_rank)
        self.phases.point(offer.payload["step_started"], Phase.JOIN)  # dies mid-transfer
        if meta is None:
            return None
        buffers = work.join_tensors()
        flat = channel.recv_bytes(donor_rank)
        if flat is None or flat.size != sum(b.nbytes for b in buffers):
            return None
        lo = 0
        for buffer in buffers:
            view = buffer.reshape(-1).view(np.uint8)
            view[:] = flat[lo:lo + view.size]
            lo += view.size
        work.load_join_meta(meta["work"])
        if self._checksum() != meta["checksum"]:
            print(f"[recover-hsdp] newcomer rank {world.world_rank}: parameters differ from the "
                  "donor's after the transfer", flush=True)
            return None
        return meta


def _donor(alive: tuple[int, ...], spawner_replica: int) -> int:
    """The replica whose ranks send the state: the lowest alive one that is not the spawner's
    (its death mid-transfer then leaves the newcomers' link intact), else the spawner's."""
    others = [r for r in alive if r != spawner_replica]
    return min(others) if others else spawner_replica
