"""[Note: phases as data]: the step's phases are announced once, and their subscribers see them.

In-process over the fake world (tests/fakes.py): the profiler labels of a step, the phase
seconds in each step's record, and the fault injector as one subscriber among others.
"""

from __future__ import annotations

import json

import torch
from torch.profiler import ProfilerActivity, profile

from fakes import values_of
from recover_hsdp.manager.phases import PhaseHooks, PhaseTimer
from recover_hsdp.phases import STEP_SPANS, Phase
from test_manager import run_job

SPANS = [f"recover/{p.value}" for p in STEP_SPANS if p is not Phase.AUDIT]  # (no audits)


def test_a_profile_of_a_step_shows_its_phases_in_the_protocols_order(tmp_path):
    """3 replicas, replica 1 dies in step 2's sync: step 2 also shows repair and rereduce."""
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # ranks
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        hub, results = run_job(tmp_path, replicas=3, g=1, steps=2,
                               faults=["replica=1,step=2,phase=grad_sync,bucket=1"])
    values_of(results, killed=[(1, 0)])
    seen = [e.name for e in prof.events() if e.name.startswith("recover/")]
    assert set(seen) == set(SPANS), sorted(set(seen))
    first = {name: seen.index(name) for name in SPANS}
    order = [first[f"recover/{p.value}"] for p in (Phase.PLAN, Phase.COMPUTE, Phase.GRAD_SYNC,
                                                     Phase.CONSENSUS)]
    assert order == sorted(order), first


def test_each_step_record_has_the_seconds_of_its_phases(tmp_path):
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=3,
                           faults=["replica=2,step=2,phase=backward"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    clean = {"plan", "compute", "grad_sync", "consensus", "commit"}
    assert set(records[0]["phase_s"]) == clean
    assert set(records[1]["phase_s"]) == clean | {"repair", "rereduce"}  # the failure step
    assert all(v >= 0 for r in records for v in r["phase_s"].values())


def test_points_reach_every_subscriber_and_spans_every_opener():
    hooks, timer, seen = PhaseHooks(), PhaseTimer(), []
    hooks.subscribe(lambda step, phase, detail: seen.append((step, phase, detail)))
    hooks.open_spans_with(timer)
    with hooks.span(4, Phase.COMPUTE):
        hooks.point(4, Phase.FORWARD)
        hooks.point(4, Phase.GRAD_SYNC, bucket=2)
    assert seen == [(4, Phase.FORWARD, {}), (4, Phase.GRAD_SYNC, {"bucket": 2})]
    assert set(timer.seconds) == {"compute"}
    timer.new_step()
    assert timer.seconds == {}
