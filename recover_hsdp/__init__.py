"""recover-hsdp: ReCoVer resilient pre-training on TorchTitan FSDP2 HSDP.

Layers (bottom to top), one module each:
  collectives.py  fault-tolerant MPI collectives (ULFM): guarded all-reduce, consensus, shrink, epoch
  recovery.py     FSDP2 bucket snapshots tagged by epoch; restore + re-reduce stale buckets
  workload.py     roles, quotas, G, boundary steps (pure Python)
  trainer.py      RecoverTrainer(torchtitan Trainer) wiring the three layers into a step
"""
