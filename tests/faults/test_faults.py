"""The paper-like failure schedule (in process): one failure per interval, seeded, distinct
victims, never the protected replica, stops at max_failures. (The real kills it drives are
those of every other real-job test; `test_end_to_end.py` runs it end to end with `-m slow`.)"""

import pytest

from recover_hsdp.faults import Phase, paper_schedule


@pytest.mark.parametrize("replicas,every,max_failures,seed", [(4, 3, 2, 7), (32, 5, 16, 1),
                                                              (8, 1, 9, 3)])
def test_paper_schedule(replicas, every, max_failures, seed):
    specs = paper_schedule(replicas, every, max_failures, Phase.GRAD_SYNC, seed)
    assert len(specs) == min(max_failures, replicas - 1)
    assert len({s.replica for s in specs}) == len(specs) and 0 not in {s.replica for s in specs}
    for i, spec in enumerate(specs):
        assert i * every + 1 <= spec.step <= (i + 1) * every and spec.phase is Phase.GRAD_SYNC
    assert specs == paper_schedule(replicas, every, max_failures, Phase.GRAD_SYNC, seed)
