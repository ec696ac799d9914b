"""``BetweenSteps``: agreements outside a step (the checkpoint gather, the end of a run).

Between two steps the survivors still agree through the fault-tolerant world before they act on
something only one replica does (the writer writes the run's outputs; the saving replica writes
a checkpoint holding every replica's loader state): a death in between makes the agreement
unclean, the world is repaired, the next writer takes over, and the round repeats. Here too,
processes excluded from the world are ended on this host ([Note: nothing left behind] in
``recover_hsdp.collectives.processes``).
"""

from __future__ import annotations

from typing import Any, Callable

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
