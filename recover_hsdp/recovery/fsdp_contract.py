"""What the recovery layer relies on in FSDP2 (torch 2.13), written down once and checked at run time.

[Note: FSDP2 contract]
``BucketSync`` restores a gradient by writing into the buffer the all-reduce hook received. That is
only correct while all of the following hold; each is checked where it can be:

1. One hook per unit per synced backward. ``FSDPModule.set_all_reduce_hook(hook)`` is called once
   for every FSDP unit (a ``fully_shard``-ed module, root included) on every backward with
   gradient sync on, in reverse unit order, on the main thread with grad mode off. Each hook is
   bound to its unit's index, so a bucket is matched to its unit by identity, never by position
   (checked: a unit that syncs twice in a step, or an extra-microbatch bucket with no matching
   bucket, fails the epoch).
2. The bucket is the flat, padded, 1-D reduce-dtype (fp32) reduce-scatter output, summed over the
   replica's S ranks (``set_force_sum_reduction_for_comms(True)``, divide factor 1: the loss is
   already divided by the step's token count). ``mixed_precision_reduce`` must be float32
   (refused otherwise by ``recover_hsdp.config.validate``).
3. The final ``.grad`` shard of every parameter of the unit is a VIEW into the bucket: in-place
   edits of the bucket are edits of the gradient. False with ``enable_cpu_offload`` (gradients
   are copied to host) and when ``reduce_dtype`` differs from the parameter dtype (a cast
   allocates a new tensor); checked once after the first synced backward by
   :func:`check_grads_are_bucket_views` (the manager calls it; a violation is a clear error).
4. One parameter group per unit (``shard_placement_fn`` per-parameter meshes make the hook
   ambiguous; FSDP itself refuses the hook then). Checked by :func:`check_unit`.
5. The hook must never raise: an exception inside it makes later steps silently skip gradient
   reduction. ``BucketSync._hook`` turns every error into a failed epoch; after a failed backward
   the root's iteration state is reset by FSDP's own next forward.

[Note: hook streams]
On GPU FSDP runs the hook on its all-reduce stream, after that stream waited for the
reduce-scatter; ``BucketSync.for_model`` gives FSDP a stream of its own for it
(``set_all_reduce_hook(hook, stream=...)``, allowed when FSDP's native HSDP is off, which it is
here). Inside the hook every device op (snapshot clone, copy to the pinned staging buffer, copy
back) is issued on that stream and the device-to-host copy is blocking, so the host sees reduced
data before MPI reads it. Outside the hook (restore + re-reduce after a repair, on the caller's
stream) ``BucketSync`` first makes the caller's stream wait for the hook stream and records the
bucket, snapshot and extra tensors on the caller's stream (``record_stream``) so the caching
allocator cannot hand their memory to the hook stream while the caller still uses it. On CPU
there are no streams and none of this applies.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule


def unit_parameters(unit: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters managed by ``unit`` itself: its parameters minus those of nested FSDP units."""
    nested: set[int] = set()
    for module in unit.modules():
        if module is not unit and isinstance(module, FSDPModule):
            nested.update(id(p) for p in module.parameters())
    return [p for p in unit.parameters() if id(p) not in nested]


def check_unit(unit: FSDPModule) -> None:
    """Item 4 of [Note: FSDP2 contract]: one parameter group per unit."""
    groups = getattr(unit._get_fsdp_state(), "_fsdp_param_groups", [None])
    if len(groups) > 1:
        raise RuntimeError(f"FSDP unit {type(unit).__name__} has {len(groups)} parameter groups "
                           "(per-parameter shard placement): the cross-replica hook needs one")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def check_grads_are_bucket_views(unit: torch.nn.Module, bucket: torch.Tensor) -> str | None:
    """Item 3 of [Note: FSDP2 contract]: every gradient of ``unit`` shares ``bucket``'s storage.

    Returns None when it holds, else one line saying which gradient does not (and the likely
    cause). Parameters without a gradient (unused this step) are skipped."""
    storage = bucket.untyped_storage().data_ptr()
    own = {id(p) for p in unit_parameters(unit)}
    for name, param in ((n, p) for n, p in unit.named_parameters() if id(p) in own):
        if param.grad is None:
            continue
        grad = _local(param.grad)
        if grad.numel() and grad.untyped_storage().data_ptr() != storage:
            return (f"the gradient of {name} is not a view of its FSDP reduce buffer (device "
                    f"{grad.device}, bucket on {bucket.device}): in-step recovery cannot restore "
                    "it; disable training.enable_cpu_offload and keep "
                    "training.mixed_precision_reduce = float32 equal to the parameter dtype")
    return None
