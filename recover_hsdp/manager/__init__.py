"""The step protocol: ``RecoverManager`` (what the trainer calls) and the process bootstrap.

  manager.py        ``RecoverManager``: [Note: the step protocol] over the three layers
  between_steps.py  agreements outside a step: checkpoint gather, [Note: the end of a run]
  build.py          ``build_manager``: one rank's manager wired from the config
  bootstrap.py      process model: MPI rank -> (replica, shard), the replica's torch.distributed
                    store

Imports torch and the three layers (collectives, recovery, workload), never torchtitan: the
trainer hands it a ``StepWork`` (forward/backward, gradient sync, optimizer update).
"""

from recover_hsdp.manager.build import build_manager
from recover_hsdp.manager.manager import RecoverManager, StepWork

__all__ = ["RecoverManager", "StepWork", "build_manager"]
