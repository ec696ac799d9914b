"""``WriterDuties``: which rank writes the run's outputs, and handing that duty over.

[Note: the writer] Rank 0's duties (metrics.jsonl, events.jsonl, ledger.jsonl, summary.json,
the final parameters) belong to shard 0 of the lowest alive replica, and DCP checkpoints to
every rank of that replica ([Note: one replica saves] in titan/trainer.py). Every rank keeps
every record in memory, so when the writer dies (or a newcomer with a lower replica id joins)
the next writer first appends what the old one had not written (``backfill_jsonl``), then
writes on: nothing is lost, nothing written twice. The duty is re-evaluated after every change
of membership (``refresh``).
"""

from __future__ import annotations

from pathlib import Path

from recover_hsdp.outputs import RunMetrics, backfill_jsonl
from recover_hsdp.workload import StepPlan
from recover_hsdp.workload.ledger import LedgerWriter, ledger_line


class WriterDuties:
    """This rank's part in [Note: the writer]: the ledger it writes, if it is the writer.

    Args:
        world: the ``World`` (collectives/interface.py).
        outputs: this rank's ``RunMetrics`` (told whether it writes).
        out_dir: the run's output folder.
    """

    def __init__(self, world, outputs: RunMetrics, out_dir: str | Path):
        self.world, self.outputs, self.out_dir = world, outputs, Path(out_dir)
        self.ledger_records: list[dict] = []  # every rank keeps them: a new writer back-fills
        self._previous: StepPlan | None = None  # the last one recorded ([Note: the compact
                                                # ledger] in workload/ledger.py)
        self._ledger: LedgerWriter | None = None
        self.outputs.set_writer(self.is_writer)
        if self.is_writer:  # the run's first writer starts the ledger afresh
            (self.out_dir / "ledger.jsonl").unlink(missing_ok=True)
            self._ledger = LedgerWriter(self.out_dir)

    @property
    def is_writer(self) -> bool:
        alive = self.world.alive_replicas  # sorted
        return bool(alive) and self.world.replica == alive[0] and self.world.shard == 0

    @property
    def saves_checkpoints(self) -> bool:
        alive = self.world.alive_replicas
        return bool(alive) and self.world.replica == alive[0]

    def refresh(self) -> None:
        """After a change of membership: hand the duty over or take it (back-filling)."""
        if self._ledger is not None and not self.is_writer:  # a newcomer took the lowest id
            self._ledger.close()
            self._ledger = None
        if self._ledger is None and self.is_writer:
            backfill_jsonl(self.out_dir / "ledger.jsonl", self.ledger_records,
                           lambda r: r["step"])
            self._ledger = LedgerWriter(self.out_dir)
        self.outputs.set_writer(self.is_writer)

    def record_commit(self, plan: StepPlan, epoch: int) -> None:
        """Every rank keeps the step's ledger line: O(1) for a step planned as the one before
        it, so no rank pays for the whole plan every step; the writer writes it."""
        line = ledger_line(plan, epoch, self._previous)
        self.ledger_records.append(line)
        self._previous = plan
        if self._ledger is not None:
            self._ledger.write(line, plan)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
