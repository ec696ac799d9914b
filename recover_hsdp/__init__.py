"""recover-hsdp: ReCoVer resilient pre-training on TorchTitan FSDP2 HSDP.

Layout, top to bottom (a module imports only from rows below it; ``lint-imports`` checks the
contracts in pyproject.toml, tests/package/test_layers.py runs it in CI):

  cli/, train.py   entry points: ``recover-hsdp`` (launch, demo); the per-rank process
  titan/           TorchTitan glue: RecoverTrainer (a thin Trainer), the recover_llama3
                   TrainSpec, metrics processor, dataloader, CPU shim
  manager/         the step protocol: RecoverManager ([Note: the step protocol]), bootstrap
  config/          the ``[recover]`` section, its sub-sections, aliases, start-up validation
  collectives/     layer 1, fault-tolerant MPI (ULFM): guarded all-reduce, consensus, epoch
  recovery/        layer 2, FSDP2 bucket snapshots tagged by epoch, restore + re-reduce
  workload/        layer 3, roles / quotas / G / boundary steps (plain Python), commit ledger
  faults.py        real failure injection      outputs.py  metrics / events / summary files
  errors.py        ConfigError

The three layers do not import each other: the manager joins them. Start reading at
``manager/manager.py``.
"""
