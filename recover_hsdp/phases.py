"""The phases of a run on one rank, as data: one enum, in [Note: the step protocol]'s order.

[Note: phases as data] ``RecoverManager.step`` walks the step phases in this order (spans:
plan, compute, grad_sync, consensus, then repair and rereduce while an epoch fails, commit),
and announces each one through one hook (``recover_hsdp.manager.phases.PhaseHooks``). What
happens at a phase is the subscribers' business, not the step's: the fault injector fires the
faults set for it, the profiler opens a ``record_function`` label ``recover/<phase>``, and the
phase timer adds its seconds to the step's record. Some phases are also announced at points
inside a span (every microbatch's forward and backward inside compute, every bucket's reduce
inside grad_sync / rereduce, every stage of the consensus, the optimizer inside commit): those
are the places a ``--fault ...,phase=P`` fires. Phases outside a step (startup, checkpoint, join,
finish) go through the same hook.

Bottom layer: the standard library only (faults, the manager and the trainer import it).
"""

from __future__ import annotations

import enum

__all__ = ["Phase", "STEP_SPANS"]


class Phase(str, enum.Enum):
    """Where a rank is. Numbers: the items of [Note: the step protocol]."""

    STARTUP = "startup"        # step=0: the replica's process group exists, the model does not
    PLAN = "plan"              # 1. the policy's plan of the step (no messages)
    COMPUTE = "compute"        # 2. forward/backward of this replica's microbatches (a span)
    FORWARD = "forward"        # 2. inside compute: one microbatch's forward
    BACKWARD = "backward"      # 2. inside compute: one microbatch's backward
    GRAD_SYNC = "grad_sync"    # 3. snapshot + cross-replica reduce of each bucket, then totals
    AUDIT = "audit"            # 3. an audit step: audited microbatches computed again
    CONSENSUS = "consensus"    # 4. was the epoch clean? (and its repair's stages, ``at=``)
    REPAIR = "repair"          # 5. after a shrink: re-plan, compute the extras
    REREDUCE = "rereduce"      # 5. restore the stale buckets from their snapshots, reduce again
    COMMIT = "commit"          # 4. clean: measured B checked, optimizer update, ledger
    OPTIMIZER = "optimizer"    # 4. inside commit: the optimizer update
    CHECKPOINT = "checkpoint"  # between steps: inside a DCP checkpoint save (the saving replica)
    JOIN = "join"              # between steps: mid-transfer of a replica rejoin
    FINISH = "finish"          # after the last step, while the writer writes the run's outputs


#: The spans of one step in the order ``RecoverManager.step`` walks them (a profile of a step
#: shows these labels); AUDIT only in an audit step; REPAIR and REREDUCE repeat while an epoch
#: fails.
STEP_SPANS = (Phase.PLAN, Phase.COMPUTE, Phase.GRAD_SYNC, Phase.AUDIT, Phase.CONSENSUS,
              Phase.REPAIR, Phase.REREDUCE, Phase.COMMIT)


def profiler_labels(step: int, phase: Phase):
    """A ``torch.profiler.record_function`` label ``recover/<phase>`` around a span: a profile
    of a step shows plan / compute / grad_sync / consensus / repair / rereduce / commit (torch
    is imported on the first span, never by importing this module)."""
    from torch.profiler import record_function

    return record_function(f"recover/{phase.value}")
