"""``BetweenSteps``: agreements outside a step (the checkpoint gather and save, the end of a run).

Between two steps the survivors still agree through the fault-tolerant world before they act on
something only one replica does (the writer writes the run's outputs; the saving replica writes
a checkpoint holding every replica's loader state): a death in between makes the agreement
unclean, the world is repaired, the next writer takes over, and the round repeats. Here too,
processes excluded from the world are ended on this host ([Note: nothing left behind] in
``recover_hsdp.collectives.processes``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from recover_hsdp.manager.failures import FailureLog
from recover_hsdp.manager.local_processes import LocalProcesses
from recover_hsdp.manager.phases import PhaseHooks
from recover_hsdp.manager.writer import WriterDuties
from recover_hsdp.phases import Phase
from recover_hsdp.workload import WorkloadPolicy


class BetweenSteps:
    """Args: the manager's world and parts (writer duties, failure log, process table, phase
    hooks)."""

    def __init__(self, *, world, writer: WriterDuties, failures: FailureLog,
                 processes: LocalProcesses, phases: PhaseHooks):
        self.world, self.writer, self.failures = world, writer, failures
        self.processes, self.phases = processes, phases

    def gather_for_checkpoint(self, local: Any, step: int,
                              policy: WorkloadPolicy) -> dict[int, Any]:
        """Every alive replica's ``local`` (this shard's), agreed by all, for a checkpoint that
        one replica writes ([Note: one replica saves]): e.g. the stream loaders' positions.
        A death during the gather makes the agreement unclean: the world is repaired and the
        survivors gather again (each round needs a new death). Returns replica -> value."""
        while True:
            values = self.world.allgather(local)
            clean = values is not None and not self.world.epoch_failed
            if self.agree(clean, "checkpoint", step, policy):
                return dict(zip(self.world.alive_replicas, values))
            self.writer.refresh()

    def gather_global(self, local: Any, phase: str, step: int,
                      policy: WorkloadPolicy) -> list[Any]:
        """Every alive rank's ``local``, agreed by all (the same repair loop as
        :meth:`gather_for_checkpoint`, over every rank): e.g. the certificate's fingerprints
        ([Note: certified checkpoints] in recover_hsdp/certificates.py)."""
        while True:
            values = self.world.allgather_global(local)
            clean = values is not None and not self.world.epoch_failed
            if self.agree(clean, phase, step, policy):
                return values
            self.writer.refresh()

    def share_state(self, has: bool, read: Callable[[], bytes], step: int,
                    policy: WorkloadPolicy) -> tuple[np.ndarray | None, list[int]]:
        """A state each rank holds or lacks for its shard position (a host-memory generation:
        [Note: host-memory state] in recovery/host_state.py), sent from one holder of each
        position to the ranks of that position that lack it, point to point (nobody else
        receives a byte). Every rank takes part in every round, whatever its position needs: who
        holds what is gathered over the whole world, so the rounds and their agreements are the
        same everywhere. A death during a transfer fails the round's agreement; the world is
        repaired and who holds what is asked again. Returns (what this rank received: None
        unless it lacked the state and got it, the shard positions no rank holds)."""
        world = self.world
        while True:
            holders: dict[int, list[int]] = {}
            lacking: dict[int, list[int]] = {}
            for shard, replica, held in sorted(self.gather_global(
                    (world.shard, world.replica, has), "state holders", step, policy)):
                (holders if held else lacking).setdefault(shard, []).append(replica)
            orphans = sorted(set(lacking) - set(holders))
            if not lacking or orphans:
                return None, orphans
            source, targets = holders[world.shard][0], lacking.get(world.shard, [])
            got, ok = None, True
            if world.replica == source and targets:
                ok = world.send_bytes(np.frombuffer(read(), dtype=np.uint8), targets)
            elif world.replica in targets:
                got = world.recv_bytes(source)
                ok = got is not None
            if self.agree(ok and not world.epoch_failed, "state transfer", step, policy):
                return got, []
            self.writer.refresh()

    def save_checkpoint(self, save: Callable[[], str | None], step: int,
                        policy: WorkloadPolicy) -> bool:
        """Save ``step``'s checkpoint on the saving replica and agree it is complete; see
        [Note: a checkpoint the survivors agree on]. ``save`` runs on every rank of the saving
        replica and returns None when it saved, else the reason (one line). Returns whether the
        checkpoint was saved.

        [Note: a checkpoint the survivors agree on] One replica writes a checkpoint ([Note: one
        replica saves] in titan/trainer.py); the others wait for it in one small exchange (an
        allgather of every rank's outcome, then the fault-tolerant agreement), so nobody goes on
        or ends the run before the save is known to be complete. Write, then agree: a saving
        rank reaches the exchange only once its save returned (DCP renames ``.metadata`` into
        the folder last, after every rank's files are written; a save starts by removing an
        older ``.metadata`` of the same step, so a half-written folder never looks complete and
        TorchTitan's loader skips it). A death makes the agreement unclean; the world is
        repaired and, if the saving replica was the one lost, the next saver (the new lowest
        alive replica, the writer's: [Note: the writer]) saves the step again from its own
        state (every replica holds the same parameters and, gathered before, the same loader
        states); a saver still alive had saved before it agreed, and says so again. Each round
        needs a new death, so this ends. A save that raised without a death (storage) is
        agreed as not saved, recorded in events.jsonl and the run goes on (redoing it on
        another replica would fail the same way). Cost without failures: the allgather of one
        small object and one agreement per save."""
        saver, mine, redone = None, None, False
        while True:
            alive = self.world.alive_replicas
            if saver not in alive:  # the first round, or the saving replica died
                redone, saver = saver is not None, min(alive)
                mine = (save() or "") if self.writer.saves_checkpoints else None
            values = self.world.allgather_global(mine)
            clean = values is not None and not self.world.epoch_failed
            if self.agree(clean, "checkpoint save", step, policy):
                break
            self.writer.refresh()
        errors = sorted({v for v in values if v})
        if redone or errors:
            self.writer.outputs.log_event({
                "step": step, "epoch": self.world.epoch, "phase": "checkpoint",
                "saved": not errors, "saved_by": saver, "redone": redone, "errors": errors})
        if errors and self.writer.is_writer:
            print(f"[recover-hsdp] step {step}: checkpoint NOT saved: {errors[0]}", flush=True)
        return not errors

    def finish_run(self, write_outputs: Callable[[], None], step: int,
                   policy: WorkloadPolicy) -> None:
        """End of the run on every surviving rank; see [Note: the end of a run].

        [Note: the end of a run] The run's last outputs (summary.json, final parameters, the
        metrics and ledger lines not yet written) are written by the writer AFTER the survivors
        agree on who is alive, and the survivors agree again once it has written. A death at any
        point (the writer dying in the final save, a rank lost during a checkpoint save) makes
        one of the two agreements unclean: the world is repaired, the next writer takes over
        (back-filling what the old one had not written) and writes everything again. Each round
        needs a new death, so this ends; then the world's last fault-tolerant agreement."""
        while True:
            self.agree(not self.world.epoch_failed, "end of run", step, policy)
            self.writer.refresh()
            if self.writer.is_writer:
                self.phases.point(step, Phase.FINISH)
                with self.world.watchdog_paused():  # a final save can take minutes
                    write_outputs()
            if self.agree(True, "end of run", step, policy):
                break
        self.writer.close()
        self.processes.end_excluded(frozen_only=False)
        self.world.finish()

    def agree(self, ok: bool, phase: str, step: int, policy: WorkloadPolicy) -> bool:
        """One fault-tolerant agreement between steps: a rank excluded by it retires; after an
        unclean one (the world was repaired) the failure is logged and frozen excluded
        processes on this host are ended. Returns whether it was clean."""
        result = self.world.consensus(ok)
        if result.retire:
            self.world.retire(phase)
        if not result.clean:
            self.failures.log_repair(step, result, policy, phase=phase)
            self.processes.end_excluded()
        return result.clean
