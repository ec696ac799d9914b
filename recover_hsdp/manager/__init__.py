"""The step protocol: ``RecoverManager`` (what the trainer calls) and the process bootstrap.

  manager.py        ``RecoverManager``: [Note: the step protocol] over the three layers and
                    the parts below (start here)
  phases.py         ``PhaseHooks``: the step's phases announced once ([Note: phases as data])
  work.py           ``StepWork`` (what the trainer does for a step), ``JoinWork`` (for a
                    rejoin), ``StepState``
  totals.py         ``StepTotals``: the step's sums across ranks, one all-reduce
  culprits.py       ``Culprits``: [Note: bad replicas], non-finite contributions absorbed
  stragglers.py     measured speed to the policy ([Note: straggler quotas])
  writer.py         ``WriterDuties``: [Note: the writer]
  failures.py       ``FailureLog``: [Note: replica-local errors], repair events
  local_processes.py ``LocalProcesses``: ending excluded processes on this host
  between_steps.py  agreements outside a step: checkpoint gather, [Note: the end of a run]
  rejoin.py         ``Rejoin``: [Note: rejoin at a boundary]
  join_state.py     ``JoinState`` (a survivor's join and its moves), ``StartedJoin``
  joins.py          ``Joins``: the join's collective operations, ``CollectiveJoins`` (MPI)
  build.py          ``build_world`` (before the model), ``build_manager``: one rank's manager
                    wired from the config
  bootstrap.py      process model: MPI rank -> (replica, shard), the replica's torch.distributed
                    store
  rendezvous.py     [Note: rendezvous address]: the address replica peers reach a rank at
  replica_group.py  the replica's process group, its timeouts (one table) and
                    [Note: a replica leaves as a unit]
  replica_heartbeat.py ``ReplicaHeartbeat``: UDP heartbeat among a replica's ranks (stdlib)

Imports torch and the three layers (collectives, recovery, workload), never torchtitan: the
trainer hands it a ``StepWork`` (forward/backward, gradient sync, optimizer update).
"""

from recover_hsdp.manager.build import build_injector_for, build_manager, build_world
from recover_hsdp.manager.manager import RecoverManager, StepWork

__all__ = ["RecoverManager", "StepWork", "build_injector_for", "build_manager", "build_world"]
