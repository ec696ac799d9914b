"""The paper-like failure schedule (in process): one failure per interval, seeded, each of a
mode from the mix, its victim drawn among the replicas alive at its step (never the lowest), the
same draw on every rank. (The real kills it drives are those of every other real-job test;
tests/manager/test_manager.py runs a mixed schedule through the step protocol;
`test_end_to_end.py` a real job with `-m soak`.)"""

import pytest

from recover_hsdp.errors import ConfigError
from recover_hsdp.faults import Mode, Phase, failure_schedule, schedule_modes

MIX = (Mode.SIGKILL, Mode.STOP, Mode.RAISE, Mode.NAN, Mode.BITFLIP)


@pytest.mark.parametrize("every,max_failures,seed", [(3, 2, 7), (5, 16, 1), (1, 9, 3),
                                                     (10, 30, 0)])
def test_schedule(every, max_failures, seed):
    schedule = failure_schedule(every, max_failures, Phase.GRAD_SYNC, seed, MIX)
    assert len(schedule) == max_failures
    for i, fault in enumerate(schedule):
        assert i * every + 1 <= fault.step <= (i + 1) * every
        assert fault.mode in MIX and 0 <= fault.pick < 1
        assert fault.phase is {Mode.NAN: Phase.GRAD_SYNC, Mode.BITFLIP: Phase.OPTIMIZER}.get(
            fault.mode, Phase.GRAD_SYNC)
    assert schedule == failure_schedule(every, max_failures, Phase.GRAD_SYNC, seed, MIX)
    if max_failures >= 16:  # a long mix draws every mode
        assert {f.mode for f in schedule} == set(MIX)


def test_victims_are_drawn_among_the_alive_never_the_lowest():
    """The same draw picks among whoever is alive: replicas that died are never drawn,
    newcomers are, and the last survivor is never drawn."""
    schedule = failure_schedule(2, 200, Phase.GRAD_SYNC, 5, (Mode.SIGKILL,))
    for alive in ((0, 1, 2, 3), (1, 3), (0, 2, 3, 4, 5), (2,)):
        victims = {f.victim(alive) for f in schedule}
        expected = set(sorted(alive)[1:]) or {None}
        assert victims == expected, (alive, victims)


def test_schedule_modes_are_checked_in_one_line():
    assert schedule_modes("sigkill, nan,bitflip", Phase.GRAD_SYNC) == (
        Mode.SIGKILL, Mode.NAN, Mode.BITFLIP)
    for text in ("", "sigkill,slow", "explode"):
        with pytest.raises(ConfigError, match=r"^recover.faults.modes=.*: use a comma-separated"):
            schedule_modes(text, Phase.GRAD_SYNC)
    with pytest.raises(ConfigError, match="raise cannot fire inside the consensus"):
        schedule_modes("raise", Phase.CONSENSUS)
