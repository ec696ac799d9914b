"""The ``recover-hsdp`` command line: its flags, and the wrong forms each one refuses.

Every flag is checked where argparse reads it (a ``type=`` below), so a wrong value ends the
command before anything is read, built or started, in argparse's one line
(``recover-hsdp train: error: argument --hostfile: ...``) that names the flag and the fix; the
config's own checks (``config.validate``) come next, in the launcher. tests/cli/test_bad_input.py
walks every flag's wrong forms.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path


def _number(kind, low=None, high=None, what: str = ""):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}{what}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = (f">= {low}" if high is None else f"in {low}..{high}")
            raise argparse.ArgumentTypeError(f"{text} is out of range: use a value {bounds}{what}")
        return value
    return parse


def existing_file(text: str) -> str:
    """A path that must name an existing file (a hostfile)."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} not found: pass the path of an existing file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file: pass the path of a file")
    return text


def output_folder(text: str) -> str:
    """A folder that may not exist yet (it is created); refused if it, or a parent, is a file."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            where = "is" if part == path else f"is under {str(part)!r}, which is"
            raise argparse.ArgumentTypeError(f"{text!r} {where} a file, not a folder: pass a "
                                             "folder (it is created if absent)")
    return text


def config_file(text: str) -> str:
    """A TOML config: must exist and be a file (its content is checked by ``load_toml``)."""
    path = Path(text)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise argparse.ArgumentTypeError(f"{text!r} {what}: pass the path of a TOML config, e.g. "
                                         "torchtitan_configs/debug_cpu.toml")
    return text


POSITIVE = _number(int, 1)
NON_NEGATIVE = _number(int, 0)
SECONDS = _number(float, 0.0, what=" (seconds)")
PORT = _number(int, 1, 65535)


def parser(description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recover-hsdp", description=description,
                                     allow_abbrev=False)  # --replica is not --replicas
    sub = parser.add_subparsers(dest="command", required=True)
    _train(sub.add_parser("train", allow_abbrev=False,
                          help="run a training job (ReCoVer via mpirun, or --stock)"))
    join = sub.add_parser("join", allow_abbrev=False,
                          help="bring a lost replica of a running job back (spawned by the job "
                               "at its next step boundary)")
    join.add_argument("--out", required=True, type=output_folder,
                      help="the running job's output directory")
    join.add_argument("--host", default=None,
                      help="host to start the replacement on (default: the job's hosts)")
    join.add_argument("--timeout", type=_number(float, 1.0, what=" (seconds)"), default=600.0,
                      help="seconds to wait for the job to take the request (default 600)")
    watch = sub.add_parser("status", allow_abbrev=False,
                           help="what every rank of a job is doing and how far the run got "
                                "(read from the files the ranks keep current)")
    watch.add_argument("out", type=output_folder, help="the job's output directory")
    demo = sub.add_parser("demo", allow_abbrev=False,
                          help="the failure demo: a failure-free reference run, then the same "
                               "job with replicas SIGKILLed during the gradient sync")
    demo.add_argument("--config", type=config_file, default="torchtitan_configs/debug_cpu.toml")
    demo.add_argument("--replicas", type=_number(int, 3, what=" (the demo kills 2 replicas)"),
                      default=4)
    demo.add_argument("--out", type=output_folder, default="outputs/demo")
    return parser


def _train(train: argparse.ArgumentParser) -> None:
    train.add_argument("--config", required=True, type=config_file, help="TorchTitan TOML config")
    train.add_argument("--replicas", type=POSITIVE, default=2, help="R, data-parallel replicas")
    train.add_argument("--ranks-per-replica", type=POSITIVE, default=None,
                       help="S, ranks per replica: pipeline_parallel_degree x FSDP degree x "
                       "tensor_parallel_degree (default: [recover] ranks_per_replica)")
    train.add_argument("--stock", action="store_true", help="stock TorchTitan HSDP via torchrun")
    train.add_argument("--out", default=None, type=output_folder,
                       help="output directory (default outputs/<config>)")
    train.add_argument("--fault", action="append", default=[], metavar="SPEC",
                       help="inject a real failure: replica=R,step=N,phase=P[,rank=K]"
                            "[,mode=sigkill|exit|hang|stop|raise][,bucket=B][,at=POINT] (repeatable)")
    train.add_argument("--hostfile", default=None, type=existing_file,
                       help="mpirun hostfile (multi-node; one rank per device)")
    train.add_argument("--gpus-per-node", type=NON_NEGATIVE, default=None, metavar="G",
                       help="GPU hosts: one rank per GPU, --map-by ppr:G:node, no "
                            "--oversubscribe (default: the launching host's CUDA devices; 0: a "
                            "CPU layout)")
    train.add_argument("--ranks-per-gpu", type=POSITIVE, default=1, metavar="K",
                       help="allow K ranks to share one GPU (e.g. a check on a 1-GPU machine; "
                            "default 1: more ranks than GPUs on a host is refused)")
    train.add_argument("--master-addr", default=None,
                       help="--stock --hostfile: the rendezvous address of rank 0 (default: "
                            "the address of the hostfile's first host)")
    train.add_argument("--master-port", type=PORT, default=random.randint(29500, 29999),
                       help="--stock --hostfile: the rendezvous port (default: 29500-29999)")
    train.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                       help="one more mpirun argument, e.g. --mpi-arg=--prtemca "
                            "--mpi-arg=plm_ssh_agent --mpi-arg=AGENT (repeatable)")
    train.add_argument("--end-grace", type=SECONDS, default=20.0, metavar="SECONDS",
                       help="after the run's summary is written, how long mpirun may take to "
                            "return before the launcher ends it (default 20)")
    train.add_argument("overrides", nargs="*", help="after --: torchtitan overrides")
