"""The step protocol: ``RecoverManager``, what the trainer calls, and the parts it holds.

  manager.py        ``RecoverManager``: [Note: the step protocol] over the three layers and
                    the parts below (start here)
  phases.py         ``PhaseHooks``: the step's phases announced once ([Note: phases as data])
  work.py           ``StepWork`` (what the trainer does for a step), ``JoinWork`` (for a
                    rejoin), ``StepState``
  totals.py         ``StepTotals``: the step's sums across ranks, one all-reduce; the measured
                    speeds to the policy ([Note: straggler quotas])
  culprits.py       ``Culprits``: [Note: bad replicas], non-finite contributions absorbed
  audits.py         ``Audits``: [Note: gradient audits], a microbatch computed again by
                    another replica, a pair that differs settled by a third
  divergence.py     ``diverged_replicas``: [Note: divergence votes], a strict majority of
                    replicas' parameter fingerprints sends the others away
  certify.py        ``Certifier``: [Note: certified checkpoints], saves certified by a vote,
                    loads verified
  writer.py         ``WriterDuties``: [Note: the writer]
  failures.py       ``FailureLog``: [Note: replica-local errors], repair events
  local_processes.py ``LocalProcesses``: ending excluded processes on this host
  between_steps.py  agreements outside a step: checkpoint gather, [Note: the end of a run]
  rejoin.py         ``Rejoin``: [Note: rejoin at a boundary]
  join_state.py     ``JoinState`` (a survivor's join and its moves), ``StartedJoin``
  joins.py          ``Joins``: the join's collective operations, ``CollectiveJoins`` (MPI)

Imports the layers below (collectives, recovery, workload; groups for the leave
path), never torch.distributed nor torchtitan (the import-linter contracts in pyproject.toml):
the trainer hands it a ``StepWork`` (forward/backward, gradient sync, optimizer update), and
the TorchTitan glue (titan/build.py) wires it from the config.
"""

from recover_hsdp.manager.manager import RecoverManager, StepWork

__all__ = ["RecoverManager", "StepWork"]
