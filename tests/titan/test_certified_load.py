"""``ReplicaCheckpointer.load`` walks the certified restart points newest first ([Note:
certified checkpoints] in recover_hsdp/certificates.py): a stand-in for TorchTitan's
``CheckpointManager`` (records what it loaded) and for the manager (the agreed verdicts); the
agreement itself is tests/manager/test_checkpoint_agreement.py, the real job
tests/jobs/test_silent_corruption.py."""

from __future__ import annotations

import types

import pytest

from recover_hsdp import certificates
from recover_hsdp.errors import ConfigError
from recover_hsdp.titan.trainer import ReplicaCheckpointer


class Inner:
    def __init__(self, folder, fail=()):
        self.folder, self.enable, self.loaded, self.fail = str(folder), True, [], set(fail)

    def load(self, step=-1):
        if step in self.fail:
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        self.loaded.append(step)
        return True


class Manager:
    def __init__(self, wrong=()):
        self.wrong, self.events, self.is_writer = set(wrong), [], True
        self.outputs = types.SimpleNamespace(log_event=self.events.append)
        self.world = types.SimpleNamespace(epoch=0)
        self.verified = []

    def verify_checkpoint(self, step, folder, fingerprint, error=""):
        self.verified.append(step)
        if error:
            return f"does not load ({error})"
        return "does not verify" if step in self.wrong else None


def _folders(root, steps, model_only=(), uncertified=(), incomplete=()):
    for step in steps:
        folder = root / f"step-{step}"
        folder.mkdir(parents=True)
        if step not in incomplete:
            (folder / ".metadata").write_text("m")
        if step not in uncertified:
            certificates.write(folder, certificates.Certificate(
                step=step, restart_point=step not in model_only, state_fingerprint="0" * 16))


def _load(root, step=-1, wrong=(), fail=(), verify=True):
    inner, manager = Inner(root, fail), Manager(wrong)
    checkpointer = ReplicaCheckpointer(inner, manager, state_fingerprint=lambda: 7, verify=verify)
    return checkpointer.load(step), inner, manager


def test_newest_first_skipping_what_is_not_a_verified_restart_point(tmp_path, capsys):
    _folders(tmp_path, [2, 4, 6, 8, 10], model_only=[10], uncertified=[8], incomplete=[6])
    loaded, inner, manager = _load(tmp_path, wrong=[4])
    assert loaded and inner.loaded == [4, 2] and manager.verified == [4, 2]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" refused:")[0] for line in lines] == [
        "[recover-hsdp] checkpoint step-10", "[recover-hsdp] checkpoint step-8",
        "[recover-hsdp] checkpoint step-4"]
    assert "model-only" in lines[0] and "no certificate" in lines[1]
    (event,) = manager.events
    assert event["loaded"] == 2 and sorted(event["refused"]) == ["10", "4", "8"]


def test_an_explicit_step_falls_back_to_older_ones_and_none_left_is_one_line(tmp_path):
    _folders(tmp_path, [2, 4, 6])
    loaded, inner, _ = _load(tmp_path, step=4, fail=[4])
    assert loaded and inner.loaded == [2]  # step-6 is newer than asked: never tried
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, wrong=[2, 4, 6])
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"checkpoint.folder {tmp_path}")
    assert "step-2: does not verify" in message and "move the folder away" in message
    with pytest.raises(ConfigError, match="step-5: not a complete checkpoint"):
        _load(tmp_path, step=5, wrong=[2, 4])


def test_what_loads_as_torchtitan_does(tmp_path):
    """No folder yet, TorchTitan's seed checkpoint (step-0 only) and a newcomer (its state comes
    from a donor) load unverified, exactly as asked."""
    assert _load(tmp_path / "none")[1].loaded == [-1]
    _folders(tmp_path / "seed", [0], uncertified=[0])
    assert _load(tmp_path / "seed")[1].loaded == [-1]
    _folders(tmp_path / "run", [2, 4], uncertified=[4])
    loaded, inner, manager = _load(tmp_path / "run", verify=False)
    assert inner.loaded == [-1] and manager.verified == []
