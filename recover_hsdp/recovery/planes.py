"""``DataPlane``: where the bytes of a bucket's cross-replica sum travel, and the ``mpi`` one.

[Note: control plane and data plane] (groups/data_plane.py) says why the bytes and the
decisions are separate. ``BucketSync`` holds one ``DataPlane`` and calls only what this
Protocol names: ``MpiDataPlane`` (below: the world's guarded all-reduce through host staging)
and ``groups.data_plane.TorchDataPlane`` (a per-epoch torch.distributed group) implement it,
and tests/package/test_interfaces.py fails when either differs from it.

The contract of every plane: ``reduce`` sums in place and returns True, or returns False
with the epoch failed (the bucket stays stale: restored and reduced again under the next
epoch); it never raises for a peer's failure and never blocks past the world's deadlines.
A plane whose ``overlap`` is true may return from ``start`` before the sum is done;
``wait`` completes the sums in the order they were started. ``prepare`` runs at the start of
every step, on the main thread, before any backward: what the step's sums need is set up
there (the ``torch`` plane's group of the epoch), not inside the first hook (on a GPU, on
autograd's device thread, inside the backward).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from recover_hsdp.recovery.staging import HostStaging


class DataPlane(Protocol):
    """The bytes of the cross-replica bucket sums (see the module docstring)."""

    name: str
    overlap: bool

    def prepare(self) -> None: ...
    def reduce(self, tensor: torch.Tensor) -> bool: ...
    def start(self, tensor: torch.Tensor) -> Any: ...
    def wait(self, pending: list[Any]) -> list[bool]: ...


class MpiDataPlane:
    """``[recover.reduce] plane = "mpi"``: the world's guarded all-reduce over the shard
    communicator (``world.allreduce``), GPU buckets through reused host chunks ([Note: no device tensor
    reaches MPI] in recovery/staging.py), CPU buckets in place. Blocking: ``start`` sums at
    once and ``wait`` hands its results back.

    Args:
        world: a ``World`` (collectives/interface.py): ``allreduce``.
        staging: the host chunks to reuse (default: a new ``HostStaging``).
    """

    name = "mpi"
    overlap = False

    def __init__(self, world, staging: HostStaging | None = None) -> None:
        self.world = world
        self.staging = staging if staging is not None else HostStaging()

    def prepare(self) -> None:
        """Nothing to set up: the world's communicators are the plane."""

    def reduce(self, tensor: torch.Tensor) -> bool:
        return self.staging.reduce(tensor, self.world.allreduce)

    def start(self, tensor: torch.Tensor) -> Any:
        return self.reduce(tensor)

    def wait(self, pending: list[Any]) -> list[bool]:
        return [bool(done) for done in pending]
