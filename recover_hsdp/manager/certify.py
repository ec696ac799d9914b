"""``Certifier``: the agreements that certify a saved checkpoint and verify a loaded one.

[Note: certified checkpoints] (recover_hsdp/certificates.py) says what is certified and why;
this module does the agreeing: every alive rank contributes (its replica, its state
fingerprint) in one fault-tolerant gather (``BetweenSteps.gather_global``), each replica's
fingerprint is its ranks' sum modulo 2^64 (free of the layout: a restart with other shards
sums to the same), and every rank reaches the same verdict from the same gathered values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from recover_hsdp import certificates
from recover_hsdp.manager.between_steps import BetweenSteps
from recover_hsdp.manager.divergence import NoMajority, diverged_replicas
from recover_hsdp.manager.writer import WriterDuties
from recover_hsdp.recovery.fingerprint import MASK
from recover_hsdp.workload import WorkloadPolicy

def replica_sums(values: list[Any]) -> tuple[dict[int, int], list[str]]:
    """Gathered ``(replica, fingerprint or None, error)`` -> each replica's summed fingerprint
    and the errors reported (a rank that could not load)."""
    sums: dict[int, int] = {}
    errors = []
    for replica, value, error in values:
        if error:
            errors.append(f"replica {replica}: {error}")
        else:
            sums[replica] = (sums.get(replica, 0) + value) & MASK
    return sums, errors


class Certifier:
    """Args: the world, the manager's ``BetweenSteps`` and ``WriterDuties``, and
    ``ranks_per_replica`` (S, recorded in the certificate)."""

    def __init__(self, *, world, between_steps: BetweenSteps, writer: WriterDuties):
        self.world, self.between_steps, self.writer = world, between_steps, writer

    def certify(self, step: int, folder: str | Path, restart_point: bool,
                fingerprint: Callable[[], int], policy: WorkloadPolicy,
                leave: Callable[[int, str], None]) -> bool:
        """After ``step``'s save was agreed complete: vote on the replicas' state
        fingerprints; the writer writes the certificate when the saving replica holds a strict
        majority's state (or is alone). A replica outside a strict majority calls
        ``leave(step, reason)`` (never returns). Returns whether it was certified (the same on
        every rank, a failed write aside: the writer's word)."""
        values = self.between_steps.gather_global((self.world.replica, fingerprint(), ""),
                                                  "checkpoint certificate", step, policy)
        sums, _ = replica_sums(values)
        try:
            diverged = diverged_replicas(step, sums)
        except NoMajority:
            diverged = tuple(sums)
        agreed = [v for r, v in sums.items() if r not in diverged]
        saver = min(sums)  # the writer's replica saved ([Note: one replica saves])
        certified = bool(agreed) and saver not in diverged
        record = {"step": step, "epoch": self.world.epoch, "phase": "certificate",
                  "certified": certified,
                  "restart_point": restart_point,
                  "replicas": {str(r): f"{v:016x}" for r, v in sorted(sums.items())},
                  "diverged": list(diverged)}
        if certified and self.writer.is_writer:
            try:
                certificates.write(folder, certificates.Certificate(
                    step=step, restart_point=restart_point, state_fingerprint=f"{agreed[0]:016x}",
                    replicas=record["replicas"],
                    ranks_per_replica=self.world.layout.ranks_per_replica))
            except OSError as err:
                certified, record["error"] = False, f"{type(err).__name__}: {err}"
        if not certified and self.writer.is_writer:
            why = record.get("error") or f"the replicas' state fingerprints {record['replicas']}"
            print(f"[recover-hsdp] step {step}: checkpoint NOT certified: {why}", flush=True)
        self.writer.outputs.log_event(record)
        if self.world.replica in diverged and agreed:  # [Note: divergence votes]
            leave(step, "diverged: this replica's state fingerprint differs from a strict "
                        "majority's at the checkpoint ([Note: divergence votes])")
        return certified

    def verify(self, step: int, folder: str | Path, fingerprint: int | None, error: str,
               policy: WorkloadPolicy) -> str | None:
        """After a load of ``folder`` (``fingerprint``: this rank's state as loaded; None and
        ``error``: the load raised): None when every replica loaded the certificate's state,
        else why not (one line, the same on every rank)."""
        certificate = certificates.read(folder)
        values = self.between_steps.gather_global((self.world.replica, fingerprint, error),
                                                  "checkpoint verification", step, policy)
        sums, errors = replica_sums(values)
        if errors:
            return f"does not load ({errors[0]})"
        if certificate is None:
            return "its certificate is gone"
        wrong = {r: v for r, v in sorted(sums.items())
                 if f"{v:016x}" != certificate.state_fingerprint}
        if wrong:
            replica, value = next(iter(wrong.items()))
            return (f"does not verify (replica {replica} loaded state fingerprint {value:016x}, "
                    f"the certificate says {certificate.state_fingerprint})")
        return None
