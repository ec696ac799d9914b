"""Host staging: the only way a tensor's bytes reach MPI.

[Note: no device tensor reaches MPI] The Open MPI wheel this project runs on is built without
CUDA support (docs/ULFM_NOTES.md), and a CUDA tensor refuses ``.numpy()``. Every path that hands
tensor memory to MPI (the bucket all-reduce, the rejoin state transfer) goes through this module:

* a CPU tensor that numpy can share (plain strided CPU memory) is passed as a zero-copy view:
  on CPU nothing is copied, exactly as before;
* any other tensor (CUDA, or anything else that refuses ``.numpy()``, bf16 included) is copied
  into a host buffer -- pinned when CUDA is present, kept and reused for the next call of the
  same size, filled and drained in chunks of at most ``chunk_bytes`` -- and, after MPI has written
  the buffer (a receive, an in-place reduce), copied back with :meth:`HostStaging.copy_back`.

Paths that carry only Python objects (the checksum is a float; the checkpoint gather and the join
metadata are pickled) pass them through :func:`to_host` so that no device tensor is pickled.
The oracle dumps are CPU copies already (``titan.metrics.full_tensors``).
Torch only: no MPI here (the recovery layer's contract).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

CHUNK_BYTES = 4 << 20
"""Largest piece copied between device and host at once (the MPI layer chunks at 4 MB too)."""


def zero_copy_view(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy array sharing ``tensor``'s memory, or None when numpy cannot share it (a device
    tensor, a dtype numpy lacks such as bfloat16, a tensor type that refuses ``.numpy()``)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    try:
        return tensor.detach().numpy()
    except (TypeError, RuntimeError):
        return None


class HostStaging:
    """Reused host buffers for tensors numpy cannot share ([Note: no device tensor reaches MPI]).

    Args:
        chunk_bytes: largest device <-> host copy at once.
        pin: page-locked buffers (default: when CUDA is available).
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, pin: bool | None = None):
        self.chunk_bytes = chunk_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[Any, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes held by the staging buffers now (the memory table's "staging" row)."""
        return sum(b.numel() for b in self._buffers.values())

    def buffer(self, key: Any, nbytes: int) -> torch.Tensor:
        """The uint8 host buffer ``key`` of at least ``nbytes`` (kept, grown when too small)."""
        held = self._buffers.get(key)
        if held is None or held.numel() < nbytes:
            held = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[key] = held
        return held[:nbytes]

    def to_numpy(self, tensors: list[torch.Tensor], key: Any = "list") -> list[np.ndarray]:
        """Writable numpy arrays of ``tensors``: zero-copy views where numpy can share the
        memory, otherwise views into ONE reused staging buffer ``key`` holding a copy. After MPI
        wrote into them call :meth:`copy_back` with the same lists."""
        views = [zero_copy_view(t) for t in tensors]
        staged = [t for t, v in zip(tensors, views) if v is None]
        flat = self.buffer(key, sum(_aligned(_nbytes(t)) for t in staged)) if staged else None
        lo = 0
        for index, (tensor, view) in enumerate(zip(tensors, views)):
            if view is None:
                host = _typed(flat[lo:lo + _nbytes(tensor)], tensor)
                host.copy_(tensor.detach(), non_blocking=self.pin)
                views[index] = _numpy(host)
                lo += _aligned(_nbytes(tensor))
        _synchronize(staged)
        return views

    def copy_back(self, tensors: list[torch.Tensor], arrays: list[np.ndarray]) -> None:
        """Copy staged arrays (from :meth:`to_numpy`) back into their tensors; views need
        nothing."""
        staged = []
        with torch.no_grad():
            for tensor, array in zip(tensors, arrays):
                if zero_copy_view(tensor) is None:
                    host = _typed(torch.from_numpy(array.reshape(-1).view(np.uint8)), tensor)
                    tensor.copy_(host, non_blocking=self.pin)
                    staged.append(tensor)
        _synchronize(staged)

    def release(self) -> None:
        """Drop every buffer (e.g. the join's full-state buffer once the join is over). Pinned
        ones go back to the OS, not to torch's pinned-host cache, where a 1B join's ~1.7 GiB
        per rank would otherwise stay for the rest of the run (:func:`return_pinned_memory`)."""
        pinned = self.pin and bool(self._buffers)
        self._buffers.clear()
        if pinned:
            return_pinned_memory()

    def reduce(self, tensor: torch.Tensor, reduce_numpy: Callable[[np.ndarray], bool]) -> bool:
        """In-place reduce of ``tensor`` through ``reduce_numpy`` (e.g. the world's guarded
        all-reduce): directly on a zero-copy view, else chunk by chunk through one reused host
        buffer (device -> host, reduce, host -> device). False as soon as a chunk fails (the
        tensor is then garbage, as after a failed direct reduce)."""
        view = zero_copy_view(tensor)
        if view is not None:
            return reduce_numpy(view)
        if not tensor.is_contiguous():
            raise ValueError("staged reduce needs a contiguous tensor (FSDP2 buckets are)")
        flat = tensor.detach().view(-1)
        step = max(1, self.chunk_bytes // tensor.element_size())
        host_bytes = self.buffer(("reduce", tensor.dtype), min(flat.numel(), step)
                                 * tensor.element_size())
        for lo in range(0, flat.numel(), step):
            piece = flat[lo:lo + step]
            host = host_bytes[:piece.numel() * piece.element_size()].view(tensor.dtype)
            host.copy_(piece)  # blocking: the host copy is complete when MPI reads it
            if not reduce_numpy(host.numpy()):
                return False
            piece.copy_(host)  # blocking: the buffer is free for the next chunk
        return True


def to_host(obj: Any) -> Any:
    """``obj`` (nested dicts / lists / tuples) with every tensor that is not on the CPU moved
    there, for paths that pickle Python objects over MPI."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


def _typed(host_bytes: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Host bytes seen as a tensor of ``like``'s dtype and shape."""
    return host_bytes.view(like.dtype).view(like.shape)


def _numpy(host: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor: typed where numpy has the dtype, bytes otherwise
    (bfloat16)."""
    try:
        return host.numpy()
    except TypeError:
        return host.reshape(-1).view(torch.uint8).numpy()


def _aligned(nbytes: int) -> int:
    """Each staged tensor starts on a 16-byte boundary (dtype views need aligned offsets)."""
    return -(-nbytes // 16) * 16


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def return_pinned_memory() -> bool:
    """Hand torch's cached, unused pinned host blocks back to the OS, where this torch can
    (``torch.accelerator.empty_host_cache``: one feature check, not a version test); pinned
    blocks still in use stay. False: this torch cannot (the cache keeps them)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        return False
    empty()
    return True


def _synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for non-blocking copies of CUDA tensors (pinned buffers) to complete."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
