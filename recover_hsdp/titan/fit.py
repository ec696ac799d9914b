"""Does a model fit where it is launched? One line before anything starts when it cannot.

The training state a rank must hold whatever else it does: its shard of the fp32 parameters,
their fp32 gradients and AdamW's two moments, 16 bytes per parameter over the model-sharding
degree of a replica (pipeline x FSDP x tensor parallel). Activations, bucket snapshots, the
unsharded accumulation and allocator slack come on top, so a layout refused here cannot run;
one accepted may still run out of memory (benchmarks/memory_table.py has the full table of the
1B layout).
"""

from __future__ import annotations

GIB = 1 << 30
STATE_BYTES_PER_PARAMETER = 16
"""fp32 parameter + fp32 gradient + AdamW exp_avg + exp_avg_sq."""


def parameter_count(job_config) -> int:
    """The model's parameters, counted on the meta device (nothing allocated)."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    from recover_hsdp.titan.model_spec import register

    register()  # idempotent: the launcher has not registered the TrainSpec
    spec = get_train_spec(job_config.model.name)
    args = spec.model_args[job_config.model.flavor]
    with torch.device("meta"):
        model = spec.model_cls(args)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def state_bytes_per_rank(job_config, ranks_per_replica: int) -> int:
    """The lower bound above for one rank of a replica of ``ranks_per_replica`` ranks."""
    return parameter_count(job_config) * STATE_BYTES_PER_PARAMETER // ranks_per_replica


def check_fits(job_config, ranks_per_replica: int, ranks_here: int, memory_bytes: int,
               where: str) -> None:
    """ConfigError (one line) when ``ranks_here`` ranks of this layout cannot hold their
    training state in ``memory_bytes`` (``where`` names that memory)."""
    from recover_hsdp.config import ConfigError

    per_rank = state_bytes_per_rank(job_config, ranks_per_replica)
    if per_rank * ranks_here <= memory_bytes:
        return
    par = job_config.parallelism
    raise ConfigError(
        f"model.flavor={job_config.model.flavor!r} does not fit: {ranks_here} rank(s) of "
        f"{per_rank / GIB:.1f} GiB each (fp32 parameters, gradients and AdamW state over "
        f"{ranks_per_replica} ranks per replica: pipeline_parallel_degree="
        f"{par.pipeline_parallel_degree} x tensor_parallel_degree="
        f"{par.tensor_parallel_degree} x FSDP, before activations) need "
        f"{per_rank * ranks_here / GIB:.1f} GiB, {where} has {memory_bytes / GIB:.1f} GiB: run "
        "it on GPUs with that memory per rank (docs/cluster.md), or raise --ranks-per-replica")


def host_memory_bytes() -> int:
    """This host's RAM (``MemTotal``)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")
