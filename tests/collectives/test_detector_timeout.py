"""Open MPI's detector timeout changed while the job runs ([Note: Open MPI's detector timeout
by phase] in recover_hsdp/collectives/detector.py): the search over a fake memory image, and real
ULFM jobs in which a frozen rank is found in the written timeout only where its observer wrote
it."""

import ctypes
import math
import struct

import pytest

from mpi_programs.mpijob import run_mpi
from recover_hsdp.collectives import detector
from recover_hsdp.collectives.detector import MPI_PROC_NULL, Region, find_detector, launch_values
from recover_hsdp.collectives.mpirun import heartbeat_detector_args

COMM = 0x7F00_1234_5678


def _struct(comm=COMM, observing=2, observer=1, timeout=30.0, period=1.0):
    return struct.pack("<QQiiddddd", comm, 0xDEAD, observing, observer, 0.0, 5.0, timeout,
                       period, 0.0)


def _image(*chunks: bytes, start=0x1000) -> Region:
    return Region(start, b"".join(chunks))


def test_finds_the_one_struct_laid_out_as_this_rank_knows():
    pad = b"\0" * 24
    other = struct.pack("<QQ", COMM, 7) + b"\1" * 40  # the comm pointer elsewhere: no layout
    image = _image(other, pad, _struct(), pad)
    at = len(other) + len(pad)
    assert find_detector([image], COMM, rank=0, size=3, timeout_s=30.0, period_s=1.0) \
        == [0x1000 + at]


@pytest.mark.parametrize("change", [
    {"timeout": 4.0},  # not the launch timeout
    {"period": 0.5},  # not the launch period
    {"observing": 0},  # this rank observing itself
    {"observer": 3},  # not a rank of the world
    {"comm": COMM + 8},  # another communicator
])
def test_a_struct_that_contradicts_what_the_rank_knows_is_not_it(change):
    image = _image(_struct(**change))
    assert find_detector([image], COMM, rank=0, size=3, timeout_s=30.0, period_s=1.0) == []


def test_before_the_detector_starts_and_unaligned():
    before = _struct(observing=MPI_PROC_NULL, observer=MPI_PROC_NULL)  # launch values copied
    assert len(find_detector([_image(before)], COMM, 0, 3, 30.0, 1.0)) == 1
    unaligned = _image(b"\0" * 4, _struct())
    assert find_detector([unaligned], COMM, 0, 3, 30.0, 1.0) == []
    # Open MPI replaces a period >= the timeout by timeout / 3
    third = _image(_struct(timeout=3.0, period=1.0))
    assert len(find_detector([third], COMM, 0, 3, timeout_s=3.0, period_s=5.0)) == 1


ENV = {"OMPI_MCA_mpi_ft_detector": "true", detector.TIMEOUT_ENV: "30", detector.PERIOD_ENV: "1"}


def test_locate_takes_one_candidate_and_refuses_two():
    raw = ctypes.create_string_buffer(_struct() + _struct())

    def image(structs):
        return lambda: ("/x/libmpi.so.40", COMM,
                        [Region(ctypes.addressof(raw), raw.raw[:64 * structs])])
    one, two = image(1), image(2)
    found, why = detector.locate(0, 3, ENV, memory=one)
    assert why == "" and found.seconds == 30.0
    found, why = detector.locate(0, 3, ENV, memory=two)
    assert found is None and "2 places in libmpi.so.40" in why and "expected 1" in why
    assert detector.locate(0, 3, ENV, memory=lambda: None) == (
        None, "libmpi is not mapped in this process")
    assert detector.locate(0, 3, {}, memory=two) == (None, "")  # no detector: nothing to say


def test_this_process_libmpi_holds_no_detector_without_mpi_init():
    """The real search runs over this process (mpi4py not initialized here): no candidate."""
    image = detector.libmpi_memory()
    if image is not None:
        lib, comm_world, regions = image
        assert find_detector(regions, comm_world, 0, 3, 30.0, 1.0) == []


def test_detector_timeout_writes_the_double_in_place():
    raw = ctypes.create_string_buffer(_struct())
    timeout = detector.DetectorTimeout(ctypes.addressof(raw), 30.0)
    assert timeout.seconds == 30.0
    timeout.set(4.0)
    assert struct.unpack_from("<d", raw.raw, 40)[0] == 4.0
    with pytest.raises(ValueError, match="> 0"):
        timeout.set(0)


def test_launch_values_from_the_environment():
    assert launch_values({}) is None
    assert launch_values({"OMPI_MCA_mpi_ft_detector": "false"}) is None
    assert launch_values({"OMPI_MCA_mpi_ft_detector": "true"}) is None  # values not given
    assert launch_values({"OMPI_MCA_mpi_ft_detector": "true", detector.TIMEOUT_ENV: "30",
                          detector.PERIOD_ENV: "1"}) == (30.0, 1.0)


def test_the_launcher_starts_open_mpi_wide_and_beats_at_the_tight_period():
    def mca(args):
        return {args[i + 1]: args[i + 2] for i, a in enumerate(args) if a == "--mca"}
    flags = mca(heartbeat_detector_args(4.0, start_timeout_s=30.0))
    assert flags["mpi_ft_detector_timeout"] == "30" and flags["mpi_ft_detector_period"] == "1"
    assert mca(heartbeat_detector_args(4.0))["mpi_ft_detector_timeout"] == "4"


WIDE_S, TIGHT_S = 30.0, 2.0


def _frozen_rank_job(tmp_path, tighten: str, watch_s: float):
    extra = heartbeat_detector_args(TIGHT_S, preconnect=True, start_timeout_s=WIDE_S)
    job = run_mpi(3, "detector_timeout.py", [str(tmp_path), str(TIGHT_S), tighten, str(watch_s)],
                  tmp_path, timeout_s=watch_s + 60, extra=extra)
    assert job.rc is not None, job.output[-3000:]
    reports = job.results()
    assert sorted(reports) == [0, 1], job.output[-3000:]  # rank 2 froze and was killed
    for rank, report in reports.items():
        assert report["found"], (rank, report["why"])
        assert report["launch_s"] == WIDE_S
    return reports


@pytest.mark.timeout(120)
def test_a_frozen_rank_is_found_in_the_timeout_its_observer_wrote(tmp_path):
    """Rank 0 observes rank 2 (Open MPI's ring: each rank observes rank - 1) and lowers its
    timeout to 2 s; rank 2 freezes: both survivors see it long before the launch's 30 s."""
    reports = _frozen_rank_job(tmp_path, tighten="0", watch_s=WIDE_S / 2)
    assert reports[0]["timeout_s"] == TIGHT_S and reports[1]["timeout_s"] == WIDE_S
    for rank, report in reports.items():
        assert report["error_after_s"] is not None, (rank, report)
        assert report["error_after_s"] < WIDE_S / 2


@pytest.mark.timeout(120)
def test_the_written_timeout_is_the_observers_own(tmp_path):
    """The same freeze with the timeout lowered by rank 1, which does not observe rank 2:
    nothing is found within 4 x the tight timeout (the launch's 30 s still holds)."""
    reports = _frozen_rank_job(tmp_path, tighten="1", watch_s=4 * TIGHT_S)
    assert reports[1]["timeout_s"] == TIGHT_S
    assert all(r["error_after_s"] is None for r in reports.values()), reports
    assert not math.isclose(reports[0]["timeout_s"], TIGHT_S)


@pytest.mark.timeout(150)
def test_a_timeout_learned_from_late_beats_survives_a_longer_silence_and_still_finds_a_freeze(
        tmp_path):
    """[Note: a steady timeout learned from beat gaps] with Open MPI's own detector: rank 0 holds
    the rank it observes stopped for 2 s four times (late beats, each under the 4 s
    ``detect_s``), then for longer than 4 s but inside the bound it learned: nobody is declared
    dead. Then the rank freezes for good and is found, after the learned bound, before the
    launch's wide timeout."""
    seconds, watch_s = 4.0, 40.0
    extra = heartbeat_detector_args(seconds, preconnect=True, start_timeout_s=watch_s)
    job = run_mpi(3, "detector_gaps.py", [str(tmp_path), str(seconds), "4", str(watch_s)],
                  tmp_path, timeout_s=2 * watch_s + 60, extra=extra)
    assert job.rc is not None, job.output[-3000:]
    reports = job.results()
    assert sorted(reports) == [0, 1], job.output[-3000:]  # rank 2 froze and was killed
    for rank, report in reports.items():
        assert report["found"], (rank, report["why"])
        assert report["steady_s"] == seconds  # no gap yet: detect_s
        assert report["after_long_pause_failed_s"] is None, (rank, report)
        assert report["error_after_s"] is not None and report["error_after_s"] < watch_s, report
    observer = reports[0]
    assert observer["learned_s"] >= 3 * seconds / 2 and observer["applied_s"] == observer["learned_s"]
    assert observer["long_pause_s"] > seconds
    assert seconds < observer["error_after_s"] <= observer["bound_before_freeze_s"] + seconds
    assert observer["gaps"] and "Open MPI's detector" in observer["gaps"][0]
