"""The CUDA device of an mpirun-launched rank ([Note: GPU placement] in collectives/mpirun.py).

TorchTitan takes ``cuda:<LOCAL_RANK>``; :func:`select_device` sets ``LOCAL_RANK`` to the device
index this rank may use, checked against the devices it sees, and binds the process to that
GPU's NUMA node where the host tells it (``/sys/bus/pci/devices/<bus id>/numa_node``). On a
CPU job without CUDA it does nothing; a GPU job whose rank sees no device is refused
(:func:`check_cpu_is_expected`). The device path itself is GPU-only code, not run on this
project's CPU machines.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Mapping

from recover_hsdp.collectives.mpirun import GPUS_PER_NODE_ENV, RANKS_PER_GPU_ENV, device_index
from recover_hsdp.config import ConfigError

NEWCOMER_ENV = "RECOVER_HSDP_NEWCOMER"  # recover_hsdp.groups.bootstrap's marker


def rank_slot(environ: Mapping[str, str], world_rank: int, ranks_per_replica: int
              ) -> tuple[int, int]:
    """(slot, slots on host) of this rank: mpirun's local rank and local size; a spawned
    newcomer (its ``world_rank`` is its rank among the spawned) takes the slot of the rank it
    replaces: that rank's world rank mod the ranks per node ``ppr:G*k:node`` placed (G and k
    exported by the launcher; without them, the newcomer's own local rank)."""
    local, size = (int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                   int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)))
    marker = environ.get(NEWCOMER_ENV)
    per_node = int(environ.get(GPUS_PER_NODE_ENV, 0) or 0) * \
        int(environ.get(RANKS_PER_GPU_ENV, 1) or 1)
    if not marker or per_node <= 0:
        return local, size
    ids = [int(r) for r in marker.split(":")[0].split(",")]
    replica, shard = divmod(world_rank, ranks_per_replica)
    replaced = ids[replica] * ranks_per_replica + shard
    return replaced % per_node, per_node


def select_device(ranks_per_replica: int, own_device=None) -> int | None:
    """Under mpirun on a CUDA host: check and set this rank's device (``LOCAL_RANK``) and bind
    it to the device's NUMA node. ``own_device``: callable telling whether this rank's single
    visible device is its own (a per-rank CUDA_VISIBLE_DEVICES; checked over MPI by the
    caller). Raises ConfigError (one line) on a mismatch, and when the job is a GPU job (the
    launcher exported its GPUs per node) but this rank sees no CUDA device: never a silent
    fall-back to CPU. None on a CPU job."""
    import torch

    env = os.environ
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "OMPI_COMM_WORLD_LOCAL_RANK" not in env:
        return None
    if visible == 0:
        check_cpu_is_expected(env, torch.version.cuda)
        return None
    slot, slots = rank_slot(env, int(env.get("OMPI_COMM_WORLD_RANK", 0)), ranks_per_replica)
    # every rank of the host asks (a collective in the caller), whatever it sees
    per_rank = bool(own_device()) if own_device is not None and slots > 1 else False
    try:
        index = device_index(slot, slots, visible, int(env.get(RANKS_PER_GPU_ENV, "1")),
                             own_device=per_rank, visible_names=env.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    env["LOCAL_RANK"] = str(index)
    bind_to_numa_node(index)
    return index


def check_cpu_is_expected(environ: Mapping[str, str], torch_cuda: str | None) -> None:
    """A rank that sees no CUDA device: fine on a CPU job, a one-line ConfigError on a GPU job
    (``RECOVER_HSDP_GPUS_PER_NODE`` > 0: ``--gpus-per-node``, or the launching host's GPUs)."""
    gpus = int(environ.get(GPUS_PER_NODE_ENV, 0) or 0)
    if gpus <= 0:
        return
    why = ("this torch has no CUDA (a CPU wheel)" if torch_cuda is None else
           f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
           if "CUDA_VISIBLE_DEVICES" in environ else "the driver shows none")
    raise ConfigError(
        f"rank {environ.get('OMPI_COMM_WORLD_RANK', '?')} on {socket.gethostname()} sees no "
        f"CUDA device ({why}) but the job was launched for {gpus} GPU(s) per node: give this "
        "host's ranks their GPUs, or run on CPU with --gpus-per-node 0")


def bind_to_numa_node(index: int) -> list[int] | None:
    """Restrict this process to the CPUs of device ``index``'s NUMA node, where the host says
    which that is; returns the CPUs, or None (unknown: left as it is)."""
    import torch

    try:
        props = torch.cuda.get_device_properties(index)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        if node < 0:
            return None
        cpus = parse_cpulist(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
        bind_process(cpus)
        return cpus
    except (AttributeError, OSError, ValueError):
        return None


def bind_process(cpus) -> list[int]:
    """Restrict the whole process to ``cpus``: every thread it has now (``sched_setaffinity``
    with 0 binds only the calling thread, and by the time a device is chosen MPI's detector,
    the watchdog and torch's pools already run), and so every thread started later (a new
    thread inherits its creator's). Returns the thread ids bound (a thread that ended
    meanwhile is skipped)."""
    bound = []
    for task in sorted(Path("/proc/self/task").iterdir(), key=lambda p: int(p.name)):
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue
        bound.append(int(task.name))
    return bound


def parse_cpulist(text: str) -> list[int]:
    """Linux cpulist syntax ("0-3,8,10-11") -> CPU ids."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    return cpus
