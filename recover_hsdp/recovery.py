"""Cross-replica gradient reduce through FSDP2's all-reduce hook.

Each FSDP unit ("bucket") calls the hook once per synced backward with its flat fp32
reduce-scatter output (the sum over the replica's S ranks: force-sum reduction, divide factor 1,
because TorchTitan already scales the loss by the global token count). The hook sums the bucket
over the replicas holding the same shard index, in place, through MPI. The result equals stock
HSDP's gradient up to fp32 summation order.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

from recover_hsdp.mpi_env import MPI


class StaticWorld:
    """Plain (not yet fault-tolerant) MPI communicators: global and per shard index."""

    def __init__(self, layout, comm=None):
        base = comm or MPI.COMM_WORLD
        self.layout = layout
        self.global_comm = base.Dup()
        self.shard_comm = base.Split(color=layout.shard, key=layout.replica)

    def is_writer(self) -> bool:
        return self.global_comm.Get_rank() == 0

    def allreduce_sum(self, buffer: np.ndarray) -> bool:
        self.shard_comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        return True

    def global_sum(self, buffer: np.ndarray) -> np.ndarray:
        self.global_comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        return buffer

    def check_replicas_identical(self, model: torch.nn.Module, step: int) -> None:
        checksum = local_parameter_checksum(model)
        values = self.shard_comm.allgather(checksum)
        if len(set(values)) != 1:
            raise RuntimeError(f"step {step}: replicas diverged: parameter checksums {values} "
                               f"for shard {self.layout.shard}")


def local_parameter_checksum(model: torch.nn.Module) -> float:
    """float64 sum of this rank's parameter shards (identical across replicas iff in sync)."""
    total = 0.0
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            total += float(local.double().sum())
    return total


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class CrossReplicaReduce:
    """Installs the MPI all-reduce hook on every FSDP unit of ``model``.

    [Note: hook contract] The hook runs on the main thread with grad mode off; the final
    ``.grad`` shard is a view into the bucket, so in-place edits are the intended use. If the
    hook raised, later steps would silently skip gradient reduction: it must never raise.
    """

    def __init__(self, model: torch.nn.Module, world):
        self.world = world
        self.units = fsdp_units(model)
        if not self.units:
            raise RuntimeError("model has no FSDP units: the cross-replica reduce needs FSDP2")
        for unit in self.units:
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(1.0)
            unit.set_all_reduce_hook(self._hook)

    def _hook(self, bucket: torch.Tensor) -> None:
        if bucket.device.type == "cpu":
            self.world.allreduce_sum(bucket.numpy())
            return
        host = bucket.to("cpu", non_blocking=False)
        self.world.allreduce_sum(host.numpy())
        bucket.copy_(host)
