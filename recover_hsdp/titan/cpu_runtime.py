"""Make TorchTitan 0.2.2 run on a machine with no accelerator (gloo, CPU tensors).

[Note: why a shim] TorchTitan picks ``device_type = "cuda"`` when no accelerator is found and
then calls CUDA-only device-module functions (``get_device_name``, ``memory_stats``, ...).
``torch.cpu`` lacks a few of them. This module, and only this module, papers over that: it
points TorchTitan's ``device_type``/``device_module`` at a CPU device module that provides the
missing functions. It does nothing when CUDA is available, so the GPU path is untouched.

Call :func:`install` before TorchTitan builds a Trainer (``recover_hsdp.train`` does).
"""

from __future__ import annotations

import os
import resource
import sys
import types
from dataclasses import dataclass

import torch

_PATCHED_NAMES = ("device_type", "device_module")


@dataclass(frozen=True)
class _CpuProperties:
    name: str
    total_memory: int


def _total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build_cpu_device_module() -> types.ModuleType:
    """torch.cpu plus the CUDA-style functions TorchTitan calls."""
    module = types.ModuleType("recover_hsdp_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    module.set_device = lambda device=None: None
    module.current_device = lambda: 0
    module.device_count = lambda: 1
    module.synchronize = lambda device=None: None
    module.empty_cache = lambda: None
    module.reset_peak_memory_stats = lambda device=None: None
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: _CpuProperties(
        "cpu", _total_memory_bytes()
    )

    def memory_stats(device=None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    module.memory_stats = memory_stats
    return module


def use_sum_reduce_scatter_on_gloo(model: torch.nn.Module) -> None:
    """gloo has no PREMUL_SUM: with TorchTitan's gradient divide factor of 1.0, FSDP's
    reduce-scatter is a plain SUM, so ask FSDP for exactly that (same math as on NCCL)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def install() -> str:
    """Point TorchTitan at the CPU when there is no GPU. Returns the device type in use."""
    if accelerator_available():
        return "cuda"
    import torchtitan.tools.utils as tt_utils

    cpu_module = _build_cpu_device_module()
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
    # Modules that did `from torchtitan.tools.utils import device_type, device_module` hold
    # their own copies: import the trainer (which imports them all) and patch every copy.
    import torchtitan.train  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is torch.cuda:
            mod.device_module = cpu_module
    return "cpu"
