"""Layer 3: the versatile workload (plain Python: imports nothing of the package, no MPI, no torch).

  plan.py        a step's plan as values (Role, ReplicaAssignment, StepPlan, DataRef)
  policy.py      roles, quotas, G and boundary steps; keeps sum of committed quotas == B
  rebalance.py   straggler quotas: weights from measured speed, with hysteresis
  assignment.py  one strategy per data assignment (exact global ids, stream slots): what ids name
  ledger.py      the commit ledger (what each committed step summed), writer and reader
  replay.py      the paper's 32 x 8 example replayed
                 (``python -m recover_hsdp.workload --replay-paper``)
"""

from recover_hsdp.workload.plan import DataAssignment, DataRef, ReplicaAssignment, Role, StepPlan
from recover_hsdp.workload.policy import GRaise, WorkloadPolicy, validate_workload_fields
from recover_hsdp.workload.rebalance import StragglerRule

__all__ = ["DataAssignment", "DataRef", "GRaise", "ReplicaAssignment", "Role", "StepPlan",
           "StragglerRule", "WorkloadPolicy", "validate_workload_fields"]
