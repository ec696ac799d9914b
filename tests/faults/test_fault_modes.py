"""The fault modes that leave the rank alive (``nan``, ``inf_loss``, ``slow``): parsing, the
one-line refusals, and what each does when its phase is announced (in process)."""

import json
import time

import pytest
import torch

from recover_hsdp.errors import ConfigError
from recover_hsdp.faults import FaultInjector, FaultSpec, Mode, Phase


def test_parse_the_new_modes():
    nan = FaultSpec.parse("replica=1,step=3,phase=grad_sync,mode=nan,bucket=2")
    assert (nan.mode, nan.phase, nan.bucket) == (Mode.NAN, Phase.GRAD_SYNC, 2)
    slow = FaultSpec.parse("replica=0,step=3,mode=slow,seconds=0.5,steps=4")
    assert (slow.mode, slow.phase, slow.seconds, slow.steps) == (Mode.SLOW, Phase.FORWARD, 0.5, 4)
    assert [slow.covers(s) for s in range(1, 9)] == [False, False, True, True, True, True,
                                                     False, False]
    forever = FaultSpec.parse("replica=0,step=3,mode=slow,seconds=1")
    assert forever.covers(3) and forever.covers(10 ** 6) and not forever.covers(2)
    assert FaultSpec.parse("replica=2,step=5,phase=forward,mode=inf_loss").mode is Mode.INF_LOSS


@pytest.mark.parametrize("text,words", [
    ("replica=1,step=3,phase=backward,mode=nan", "mode=nan fires at phase=grad_sync"),
    ("replica=1,step=3,phase=grad_sync,mode=slow", "mode=slow fires at phase=forward"),
    ("replica=1,step=3,mode=sigkill,steps=2", "steps=K is for mode=slow only"),
    ("replica=1,step=3,mode=slow,seconds=-1", "seconds must be >= 0"),
    ("replica=1,step=3,mode=slow,times=0.5", "times=F is for mode=slow only, with F >= 1"),
    ("replica=1,step=3,mode=hang,times=2", "times=F is for mode=slow only"),
])
def test_refused_in_one_line(text, words):
    with pytest.raises(ConfigError, match=words) as info:
        FaultSpec.parse(text)
    assert "\n" not in str(info.value)


def _injector(tmp_path, text, replica=1):
    return FaultInjector([FaultSpec.parse(text)], replica=replica, shard=0, out_dir=tmp_path)


def test_nan_poisons_the_chosen_bucket_and_its_snapshot_only(tmp_path):
    faults = _injector(tmp_path, "replica=1,step=3,phase=grad_sync,mode=nan,bucket=1")
    buckets = [(torch.ones(4), torch.ones(4)) for _ in range(3)]
    for step in (2, 3):
        for index, pair in enumerate(buckets):
            faults.at(step, Phase.GRAD_SYNC, bucket=index, tensors=pair)
        faults.at(step, Phase.GRAD_SYNC, bucket=3, buckets_total=3)  # after the last one
    finite = [bool(torch.isfinite(t).all()) for pair in buckets for t in pair]
    assert finite == [True, True, False, False, True, True]
    fired = [json.loads(line)
             for line in (tmp_path / "faults_fired.jsonl").read_text().splitlines()]
    assert [(f["step"], f["mode"], f["bucket"]) for f in fired] == [(3, "nan", 1)]


def test_nan_beyond_the_last_bucket_poisons_the_last_one(tmp_path):
    faults = _injector(tmp_path, "replica=1,step=3,phase=grad_sync,mode=nan,bucket=9")
    last = (torch.ones(2), torch.ones(2))
    first = (torch.ones(2),)
    faults.at(3, Phase.GRAD_SYNC, bucket=0, buckets_total=2, tensors=first)
    faults.at(3, Phase.GRAD_SYNC, bucket=1, buckets_total=2, tensors=last)
    faults.at(3, Phase.GRAD_SYNC, bucket=2, buckets_total=2)  # after the last: nothing to poison
    assert torch.isfinite(first[0]).all() and not torch.isfinite(last[0]).any()


def test_inf_loss_changes_only_that_steps_loss_and_records_once(tmp_path):
    faults = _injector(tmp_path, "replica=1,step=3,phase=forward,mode=inf_loss")
    assert faults.loss_of(2, 0.5) == 0.5
    assert faults.loss_of(3, 0.5) == float("inf") and faults.loss_of(3, 0.7) == float("inf")
    assert faults.loss_of(4, 0.5) == 0.5
    assert len((tmp_path / "faults_fired.jsonl").read_text().splitlines()) == 1
    other = _injector(tmp_path, "replica=1,step=3,phase=forward,mode=inf_loss", replica=0)
    assert other.mine == [] and other.loss_of(3, 0.5) == 0.5


def test_slow_sleeps_before_each_forward_for_its_steps(tmp_path):
    faults = _injector(tmp_path, "replica=1,step=2,mode=slow,seconds=0.05,steps=2")
    took = {}
    for step in (1, 2, 3, 4):
        started = time.perf_counter()
        for _ in range(2):
            faults.at(step, Phase.FORWARD)
            faults.at(step, Phase.BACKWARD)
        took[step] = time.perf_counter() - started
    assert took[1] < 0.05 and took[4] < 0.05
    assert took[2] >= 0.1 and took[3] >= 0.1
    assert len((tmp_path / "faults_fired.jsonl").read_text().splitlines()) == 1


def test_slow_times_f_is_relative_to_the_last_microbatch_before_the_fault(tmp_path):
    faults = _injector(tmp_path, "replica=1,step=2,mode=slow,times=3")
    started = time.perf_counter()
    faults.at(2, Phase.FORWARD, last_microbatch_s=0.04)    # sleeps (3 - 1) x 0.04 s
    faults.at(3, Phase.FORWARD, last_microbatch_s=0.12)    # the base stays the one before
    took = time.perf_counter() - started
    assert 0.16 <= took < 0.3, took
