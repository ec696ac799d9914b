"""Process entry point: ``python -m recover_hsdp.train --job.config_file FILE [overrides]``.

Run under mpirun (``[recover] enable = true``: ``RecoverTrainer``, one MPI rank per device) or,
for ``enable = false`` (TorchTitan's own ``Trainer``, stock HSDP), under torchrun on one host or
mpirun across hosts (``RECOVER_HSDP_STOCK=1``: torch's env:// variables from mpirun's).
``recover-hsdp train`` builds these command lines. Under mpirun on a CUDA host the rank's device
is checked first ([Note: GPU placement]). A bad configuration stops every rank with one line on
stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from recover_hsdp.errors import ConfigError  # standard library only: nothing before MPI_Init


def _config_file(argv: list[str]) -> str | None:
    for index, arg in enumerate(argv):
        for key in ("--job.config_file", "--job.config-file"):
            if arg == key and index + 1 < len(argv):
                return argv[index + 1]
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1]
    return None


STOCK_ENV = "RECOVER_HSDP_STOCK"
"""Set by ``recover-hsdp train --stock --hostfile``: stock TorchTitan launched by mpirun across
hosts; its ranks read torch's env:// variables from mpirun's and never initialise MPI."""


def torch_env_from_mpirun(environ=os.environ) -> None:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE from mpirun's OMPI_COMM_WORLD_*
    (MASTER_ADDR / MASTER_PORT come from the launcher)."""
    for name, source in (("RANK", "RANK"), ("WORLD_SIZE", "SIZE"), ("LOCAL_RANK", "LOCAL_RANK"),
                         ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")):
        environ[name] = environ[f"OMPI_COMM_WORLD_{source}"]


def _own_device() -> bool:
    """Whether each rank of this host sees a CUDA_VISIBLE_DEVICES no other rank of the host
    sees (a per-rank setting): a collective over the host's ranks."""
    from recover_hsdp.collectives.mpi import MPI

    host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        names = host.allgather(os.environ.get("CUDA_VISIBLE_DEVICES"))
    finally:
        host.Free()
    return None not in names and len(set(names)) == len(names)


def _option(argv: list[str], key: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == key and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(key + "="):
            return arg.split("=", 1)[1]
    return None


def _failed_world_ranks() -> list[int]:
    """The ranks of COMM_WORLD this process's MPI knows to have failed (ULFM; empty if none
    or if it cannot tell)."""
    try:
        from recover_hsdp.collectives.mpi import MPI

        world = MPI.COMM_WORLD
        group, whole = world.Get_failed(), world.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), whole)
        finally:
            group.Free()
            whole.Free()
        return [r for r in ranks if r != MPI.UNDEFINED]
    except Exception:  # noqa: BLE001 - evidence only: never in the way of the exit
        return []


def _start_record(argv: list[str], exited: str | None = None) -> None:
    """[Note: start-up records] (collectives/processes.py): where this rank runs, written
    right after MPI_Init, and its reason (with the ranks it knew failed) when it leaves
    through an exception. Never fails."""
    out = _option(argv, "--job.dump_folder")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    if out is None or rank is None or os.environ.get("RECOVER_HSDP_NEWCOMER"):
        return
    try:
        from recover_hsdp.collectives.processes import write_start_record

        write_start_record(out, int(rank), exited,
                           _failed_world_ranks() if exited is not None else None)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def _bounded_mpi_init(environ=os.environ):
    """[Note: a bounded MPI_Init] Open MPI 5.0's detector thread sends its first heartbeat from
    inside MPI_Init, right after the modex fence, to a peer that may not have left that fence
    yet; such a peer has not registered the message's handler and jumps to it (NULL), and the
    others crash on its failure notice ("Failing at address: (nil)", then
    ``ompi_comm_revoke_local``: benchmarks/README.md "False deaths"). A rank whose own detector
    thread is then connecting to a dead peer waits in ``PMIx_Get`` for its address forever,
    and MPI_Init with it (its main thread spinning until the thread reports in): measured once,
    the attempt alive 10 minutes later with that one rank, mpirun never ending, so the relaunch
    tier never saw it end. MPI_Init gives no timeout, and the main thread is inside one C call
    holding the GIL, so no Python thread can end it. So the rank arms ``SIGALRM`` (its default
    action ends the process; nothing here installs a handler) for ``recover.timeouts.hang_s``
    (the launcher exports it: ``INIT_DEADLINE_ENV``), the bound the user set for a rank that
    shows no progress, and disarms it when MPI_Init returns. A rank that outlives it dies as a
    crashed start-up rank, the attempt ends, and the relaunch tier starts it again as it was
    (cli/relaunch.py, ``init_crashes``)."""
    from recover_hsdp.collectives.mpirun import INIT_DEADLINE_ENV  # stdlib only

    seconds = int(environ.get(INIT_DEADLINE_ENV, "0") or 0)
    if seconds > 0:
        signal.alarm(seconds)
    try:
        yield
    finally:
        if seconds > 0:
            signal.alarm(0)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    mpirun = "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ
    stock = os.environ.get(STOCK_ENV) == "1"
    if mpirun and stock:
        torch_env_from_mpirun()
    elif mpirun:  # launched by mpirun: one rank per device
        os.environ.setdefault("LOCAL_RANK", os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
        # MPI_Init first, before any heavy import (numpy, torch): the heartbeat detector
        # (recover.timeouts.detect_s) then runs on every rank from the start, and the ranks
        # reach MPI_Init close together: Open MPI's detector thread starts early in MPI_Init and
        # a rank waiting there for a late peer misses its beats ([Note: detection margins by
        # phase] in groups/heartbeat.py). Within a deadline: [Note: a bounded MPI_Init].
        with _bounded_mpi_init():
            import recover_hsdp.collectives.mpi  # noqa: F401
        _start_record(argv)
    try:
        config_file = _config_file(argv)
        if config_file is not None:
            from recover_hsdp.config import load_toml  # tyro: after MPI_Init

            load_toml(config_file)
        from recover_hsdp.titan import cpu_runtime, model_spec

        cpu_runtime.install()
        model_spec.register()
        import torchtitan.train
        from torchtitan.config import ConfigManager

        recover = getattr(ConfigManager().parse_args(argv), "recover", None)
        if mpirun:  # [Note: GPU placement]: the device checked against the visible ones
            from recover_hsdp.titan.devices import select_device

            select_device(recover.ranks_per_replica if recover is not None else 1,
                          own_device=None if stock else _own_device)
        if recover is not None and recover.enable:
            from recover_hsdp.titan.trainer import RecoverTrainer as trainer_class
        else:
            trainer_class = torchtitan.train.Trainer  # stock TorchTitan, unchanged
        sys.argv = [sys.argv[0], *argv]
        torchtitan.train.main(trainer_class)
    except ConfigError as err:
        print(f"recover-hsdp: config error: {err}", file=sys.stderr, flush=True)
        if mpirun and not stock:  # the relaunch tier: a configuration error ends the same way
            _start_record(argv, exited=f"SystemExit: 2 (config error: {str(err)[:150]})")
        sys.exit(2)
    except BaseException as err:
        if mpirun and not stock:
            _start_record(argv, exited=f"{type(err).__name__}: {str(err)[:400]}")
        raise


if __name__ == "__main__":
    main()
