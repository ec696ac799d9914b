"""Agreements outside a step: the checkpoint gather and the end of a run (RecoverManager's).

Between two steps the survivors still agree through the fault-tolerant world before they act on
something only one replica does (the writer writes the run's outputs; the saving replica writes
a checkpoint holding every replica's loader state): a death in between makes the agreement
unclean, the world is repaired, the next writer takes over, and the round repeats. Here too,
processes excluded from the world are ended on this host ([Note: nothing left behind] in
``recover_hsdp.collectives.processes``).
"""

from __future__ import annotations

from typing import Any, Callable

from recover_hsdp.collectives.processes import kill_local
from recover_hsdp.faults import Phase


class BetweenSteps:
    """Mixin of :class:`recover_hsdp.manager.RecoverManager` (uses its world, outputs, ledger,
    faults, procs and writer duties)."""

    def gather_for_checkpoint(self, local: Any) -> dict[int, Any]:
        """Every alive replica's ``local`` (this shard's), agreed by all, for a checkpoint that
        one replica writes ([Note: one replica saves]): e.g. the stream loaders' positions.
        A death during the gather makes the agreement unclean: the world is repaired and the
        survivors gather again (each round needs a new death). Returns replica -> value."""
        while True:
            values = self.world.allgather(local)
            if self._agree(values is not None and not self.world.epoch_failed, "checkpoint"):
                return dict(zip(self.world.alive_replicas, values))
            self._take_over_writer_duties()

    def finish_run(self, write_outputs: Callable[[], None]) -> None:
        """End of the run on every surviving rank; see [Note: the end of a run].

        [Note: the end of a run] The run's last outputs (summary.json, final parameters, the
        metrics and ledger lines not yet written) are written by the writer AFTER the survivors
        agree on who is alive, and the survivors agree again once it has written. A death at any
        point (the writer dying in the final save, a rank lost during a checkpoint save) makes
        one of the two agreements unclean: the world is repaired, the next writer takes over
        (back-filling what the old one had not written) and writes everything again. Each round
        needs a new death, so this ends; then the world's last fault-tolerant agreement."""
        self.abandon_join(self._current_step)  # newcomers still starting: [Note: rejoin ...]
        while True:
            self._agree(not self.world.epoch_failed, "end of run")
            self._take_over_writer_duties()
            if self.is_writer:
                self.faults.at(self._current_step, Phase.FINISH)
                write_outputs()
            if self._agree(True, "end of run"):
                break
        if self.ledger is not None:
            self.ledger.close()
        self._end_excluded(frozen_only=False)
        self.world.finish()

    def _agree(self, ok: bool, phase: str) -> bool:
        """One fault-tolerant agreement between steps: a rank excluded by it retires; after an
        unclean one (the world was repaired) the failure is logged and frozen excluded
        processes on this host are ended. Returns whether it was clean."""
        result = self.world.consensus(ok)
        if result.retire:
            self.world.retire(phase)
        if not result.clean:
            self._log_failure_between_steps(result, phase)
            self._end_excluded()
        return result.clean

    def _end_failed(self, ranks: list[int]) -> None:
        """Ranks a failed MPI call reported: end at once those frozen on this host. A frozen
        rank keeps its sockets open, so its replica peers stay blocked in an intra-replica
        collective (and, through their shard communicators, the other replicas) until it really
        dies; its death frees them now instead of at their hang watchdog."""
        self._end_on_this_host(ranks, frozen_only=True)

    def _end_excluded(self, frozen_only: bool = True) -> None:
        """SIGKILL the processes of excluded replicas that run on this host: [Note: nothing
        left behind]. After a repair only frozen ones (stopped: they hold memory and mpirun, and
        will never move); at the end of the run every one still there (a rank of a dead replica
        retires by itself within its grace period, so it is not killed while it leaves)."""
        alive = set(self.world.layout.alive_ranks())
        self._end_on_this_host([r for r in range(len(self.procs)) if r not in alive],
                               frozen_only)

    def _end_on_this_host(self, ranks, frozen_only: bool) -> None:
        procs = [self.procs[r] for r in ranks if r < len(self.procs)]
        killed = kill_local([p for p in procs if p.is_frozen()] if frozen_only else procs)
        if killed:
            print(f"[recover-hsdp] rank {self.world.world_rank}: ended "
                  f"{'frozen ' if frozen_only else ''}processes of ranks out of the world "
                  f"{killed} on this host", flush=True)

    def _log_failure_between_steps(self, result, phase: str) -> None:
        self.outputs.log_event({
            "step": self._current_step, "epoch": result.epoch, "phase": phase,
            "dead_replicas": sorted(result.dead_replicas),
            "alive_replicas": list(result.alive_replicas), "detect_s": result.detect_s,
            "repair_s": result.repair_s, "repair_rounds": result.rounds,
            "errors": self._replica_errors(result.dead_replicas),
            **self._unread_streams(result.dead_replicas)})

    def close(self) -> None:
        """Without ``finish_run`` (a run that failed): close the ledger, then the world's last
        fault-tolerant agreement."""
        if self.ledger is not None:
            self.ledger.close()
        self.world.finish()
