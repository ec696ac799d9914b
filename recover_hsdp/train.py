"""Process entry point: ``python -m recover_hsdp.train --job.config_file FILE [overrides]``.

Run under mpirun (``[recover] enable = true``: ``RecoverTrainer``, one MPI rank per device) or
torchrun (``enable = false``: TorchTitan's own ``Trainer``, stock HSDP). ``recover-hsdp train`` builds these command lines. A bad configuration stops
every rank with one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys

from recover_hsdp.config import ConfigError, load_toml


def _config_file(argv: list[str]) -> str | None:
    for index, arg in enumerate(argv):
        for key in ("--job.config_file", "--job.config-file"):
            if arg == key and index + 1 < len(argv):
                return argv[index + 1]
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:  # launched by mpirun: one rank per device
        os.environ.setdefault("LOCAL_RANK", os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
        # MPI_Init first, before the seconds of torch imports: the heartbeat detector
        # (recover.detect_timeout_s) then runs on every rank from the start, and start-up skew
        # between ranks stays small.
        import recover_hsdp.collectives.world  # noqa: F401
    try:
        config_file = _config_file(argv)
        if config_file is not None:
            load_toml(config_file)
        from recover_hsdp.titan import cpu_runtime, model_spec

        cpu_runtime.install()
        model_spec.register()
        import torchtitan.train
        from torchtitan.config import ConfigManager

        recover = getattr(ConfigManager().parse_args(argv), "recover", None)
        if recover is not None and recover.enable:
            from recover_hsdp.titan.trainer import RecoverTrainer as trainer_class
        else:
            trainer_class = torchtitan.train.Trainer  # stock TorchTitan, unchanged
        sys.argv = [sys.argv[0], *argv]
        torchtitan.train.main(trainer_class)
    except ConfigError as err:
        print(f"recover-hsdp: config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
