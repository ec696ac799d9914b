"""Every flag of the ``recover-hsdp`` command line, in each of its wrong forms (a missing
path, a file where a folder is expected, a folder where a file is, a bad type, out of range):
a non-zero exit, exactly one error line naming the flag, no traceback, nothing started and no
output folder created. Run in process (``launch.main``): the checks stop before any job."""

from __future__ import annotations

from conftest import DEBUG_CONFIG
from recover_hsdp.cli import launch

CONFIG = str(DEBUG_CONFIG)


def _cases(tmp):
    a_file = tmp / "a_file"
    a_file.write_text("x\n")
    folder = tmp / "folder"
    folder.mkdir()
    missing = str(tmp / "missing")
    train = ["train", "--config", CONFIG]
    return {
        "train --config missing": (["train", "--config", missing], "--config"),
        "train --config folder": (["train", "--config", str(folder)], "--config"),
        "train --replicas type": ([*train, "--replicas", "two"], "--replicas"),
        "train --replicas 0": ([*train, "--replicas", "0"], "--replicas"),
        "train --ranks-per-replica type": ([*train, "--ranks-per-replica", "1.5"],
                                           "--ranks-per-replica"),
        "train --ranks-per-replica 0": ([*train, "--ranks-per-replica", "0"],
                                        "--ranks-per-replica"),
        "train --out file": ([*train, "--out", str(a_file)], "--out"),
        "train --out under a file": ([*train, "--out", str(a_file / "run")], "--out"),
        "train --fault garbage": ([*train, "--fault", "replica=x"], "fault"),
        "train --hostfile missing": ([*train, "--hostfile", missing], "--hostfile"),
        "train --hostfile folder": ([*train, "--hostfile", str(folder)], "--hostfile"),
        "train --gpus-per-node type": ([*train, "--gpus-per-node", "many"], "--gpus-per-node"),
        "train --gpus-per-node -1": ([*train, "--gpus-per-node", "-1"], "--gpus-per-node"),
        "train --ranks-per-gpu 0": ([*train, "--ranks-per-gpu", "0"], "--ranks-per-gpu"),
        "train --master-port type": ([*train, "--master-port", "http"], "--master-port"),
        "train --master-port range": ([*train, "--master-port", "70000"], "--master-port"),
        "train --end-grace type": ([*train, "--end-grace", "soon"], "--end-grace"),
        "train --end-grace -1": ([*train, "--end-grace", "-1"], "--end-grace"),
        "train override": ([*train, "--", "--training.steps", "many"], "training.steps"),
        "train unknown flag": ([*train, "--replica", "2"], "--replica"),
        "join --out file": (["join", "--out", str(a_file)], "--out"),
        "join --out missing": (["join", "--out", missing], "--out"),
        "join --timeout type": (["join", "--out", str(folder), "--timeout", "x"], "--timeout"),
        "join --timeout 0": (["join", "--out", str(folder), "--timeout", "0"], "--timeout"),
        "demo --config missing": (["demo", "--config", missing], "--config"),
        "demo --replicas 2": (["demo", "--replicas", "2"], "--replicas"),
        "demo --out file": (["demo", "--out", str(a_file)], "--out"),
    }


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        import tempfile
        from pathlib import Path

        names = sorted(_cases(Path(tempfile.mkdtemp(prefix="recover-flag-names-"))))
        metafunc.parametrize("case", names)


def test_a_wrong_flag_ends_in_one_line(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default output folder would land here
    argv, flag = _cases(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = launch.main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and flag in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created
