"""The chaos simulator's parts (issue 34; ``benchmarks/chaos_sim.py`` runs them).

  trace.py      the failure trace: the Llama 3 405B interruption mix as a rate per GPU-hour
  inputs.py     every cost and setting, each with where it comes from (a results file, the
                config's default, or a stated constant)
  engine.py     the event loop, the ledger of progress and lost time, checkpoints, the host pool
  baselines.py  checkpoint-restart (Young's interval), TorchFT-like, FT-HSDP-like
  probe.py      the project's real ``WorkloadPolicy``, called at events, with the invariant checked
  recover.py    this project: the policy, the split-brain arbiter, the relaunch planning and the
                hang bound, all the real objects

Nothing here is imported by the product; the tests import it through ``chaos_sim``.
"""
