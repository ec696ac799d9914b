"""Per-rank memory of a ReCoVer HSDP job, computed from the code's own sizes (not guessed).

    python benchmarks/memory_table.py [--config torchtitan_configs/llama3_1b_hsdp.toml]
                                      [--replicas 8] [--ranks-per-replica 8] [--json OUT]

Builds the model on the meta device, applies TorchTitan's FSDP2 plan over a fake S-rank backend
(as tests/titan/test_model_1b.py does) and reads, per FSDP unit, FSDP2's own padded shard sizes, the
parameters' dtypes and the mixed-precision policy. Rows (bytes per rank):

* params: the fp32 sharded parameters (FSDP2 pads each parameter's dim 0 to a multiple of S);
* grads = buckets: the reduce-scatter outputs in the reduce dtype, one per FSDP unit; the
  ``.grad`` shards are views into them ([Note: FSDP2 contract]);
* AdamW state: exp_avg + exp_avg_sq, fp32, the size of the (unpadded) local shards;
* accumulation (G >= 2): under ``set_requires_gradient_sync(False)`` FSDP2 keeps each
  parameter's UNSHARDED gradient in the reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``:
  ``unsharded_accumulated_grad = grad.to(reduce_dtype)``) until the synced microbatch;
* snapshots: one clone per bucket (device; pinned host with ``recover.reduce.host_snapshots``);
* staging: the bucket reduce's reused host chunk (recovery/staging.py), and, during a join only,
  the host copy of the donor's / newcomer's parameters + optimizer state (released next step);
* all-gather: the two largest units' unsharded parameters in the param dtype (one unit and
  the prefetched next).
Activations are not counted (they depend on AC and the sequence length).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GIB = 1 << 30


def _sizes(config: str, ranks: int) -> dict:
    """Per-unit sizes of the model of ``config`` sharded ``ranks`` ways (fake backend)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from recover_hsdp.titan import cpu_runtime, model_spec

    cpu_runtime.install()
    model_spec.register()
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = ConfigManager().parse_args(["--job.config_file", config])
    spec = get_train_spec(cfg.model.name)
    args = spec.model_args[cfg.model.flavor]
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = spec.model_cls(args)
    total = sum(p.numel() for p in model.parameters())
    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        dims = ParallelDims(dp_shard=ranks, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                            world_size=ranks)
        model = spec.parallelize_fn(model, dims, cfg)
        units = []
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            params = group.fsdp_params
            units.append({
                "padded_shard": sum(p.padded_sharded_param_size.numel() for p in params),
                "local_shard": sum(p.sharded_param.to_local().numel() for p in params),
                "unsharded": sum(p._orig_size.numel() for p in params),
                "param_bytes": params[0].sharded_param.element_size(),
                "gather_bytes": _itemsize(group.mp_policy.param_dtype, params[0]),
                "reduce_bytes": _itemsize(group.mp_policy.reduce_dtype, params[0])})
    finally:
        dist.destroy_process_group()
    lbs, gbs = cfg.training.local_batch_size, cfg.training.global_batch_size
    return {"params_total": total, "units": units, "local_batch_size": lbs,
            "global_batch_size": gbs, "host_snapshots": cfg.recover.reduce.host_snapshots}


def _itemsize(dtype, param) -> int:
    import torch

    return torch.empty(0, dtype=dtype or param.sharded_param.dtype).element_size()


def accumulation_steps(sizes: dict, replicas: int, ranks: int) -> int:
    """G: microbatches per rank per step (global batch / (R x S x local batch))."""
    return sizes["global_batch_size"] // (replicas * ranks * sizes["local_batch_size"])


def table(sizes: dict, replicas: int, ranks: int) -> list[dict]:
    """The rows: name, bytes per rank, where, note."""
    from recover_hsdp.recovery.staging import CHUNK_BYTES

    units = sizes["units"]
    g = accumulation_steps(sizes, replicas, ranks)
    buckets = sum(u["padded_shard"] * u["reduce_bytes"] for u in units)
    local = sum(u["local_shard"] for u in units)
    snap_where = "pinned host" if sizes["host_snapshots"] else "device"
    rows = [
        ("params (sharded, fp32)", sum(u["padded_shard"] * u["param_bytes"] for u in units),
         "device", ""),
        ("grads = buckets (reduce dtype)", buckets, "device", f"{len(units)} buckets, largest "
         f"{max(u['padded_shard'] * u['reduce_bytes'] for u in units) / 2**20:.0f} MiB"),
        ("AdamW exp_avg + exp_avg_sq (fp32)", 2 * 4 * local, "device", ""),
        (f"accumulation, unsharded, reduce dtype (G = {g})",
         sum(u["unsharded"] * u["reduce_bytes"] for u in units) if g > 1 else 0, "device",
         "FSDP2 no-sync: full model per rank"),
        ("bucket snapshots", buckets, snap_where, "recover.reduce.host_snapshots moves them to host"),
        ("all-gathered params, 2 largest units (param dtype)",
         sum(sorted(u["unsharded"] * u["gather_bytes"] for u in units)[-2:]), "device",
         "transient (current + prefetched unit)"),
        ("bucket reduce staging (GPU only)", CHUNK_BYTES, "pinned host",
         f"one reused {CHUNK_BYTES >> 20} MiB chunk"),
        ("join staging (GPU only, during a join)",
         sum(u["local_shard"] * u["param_bytes"] for u in units) + 2 * 4 * local,
         "pinned host", "released at the next step"),
    ]
    return [{"row": r, "bytes": b, "where": w, "note": n} for r, b, w, n in rows]


def render(rows: list[dict], sizes: dict, replicas: int, ranks: int) -> str:
    lines = [f"{sizes['params_total']:,} parameters, {replicas} replicas x {ranks} ranks",
             "", "| per rank | GiB | where | note |", "|---|---:|---|---|"]
    lines += [f"| {r['row']} | {r['bytes'] / GIB:.2f} | {r['where']} | {r['note']} |"
              for r in rows]
    device = sum(r["bytes"] for r in rows if r["where"] == "device")
    lines.append(f"| **device total (no activations)** | **{device / GIB:.2f}** | device | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "torchtitan_configs" /
                                                "llama3_1b_hsdp.toml"))
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--ranks-per-replica", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    sizes = _sizes(args.config, args.ranks_per_replica)
    rows = table(sizes, args.replicas, args.ranks_per_replica)
    print(render(rows, sizes, args.replicas, args.ranks_per_replica))
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
