"""The Llama 3.2 1B flavor builds on the meta device and the FSDP plan applies (fake backend)."""

import subprocess
import sys
import textwrap

from conftest import REPO

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from recover_hsdp import cpu_runtime, model_spec
    cpu_runtime.install(); model_spec.register()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = ConfigManager().parse_args(["--job.config_file",
                                      "torchtitan_configs/llama3_1b_hsdp.toml"])
    spec = get_train_spec(cfg.model.name)
    args = spec.model_args[cfg.model.flavor]
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = spec.model_cls(args)
    n_params = sum(p.numel() for p in model.parameters())
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    dims = ParallelDims(dp_shard=8, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=8)
    model = spec.parallelize_fn(model, dims, cfg)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    local = sum(p.to_local().numel() for p in model.parameters())
    print(f"PARAMS {n_params} UNITS {len(units)} LOCAL {local}")
""")


def test_1b_builds_on_meta_and_fsdp_plan_applies():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("PARAMS")][-1]
    _, params, _, units, _, local = line.split()
    assert 1.20e9 < int(params) < 1.28e9, params      # Llama 3.2 1B: ~1.24B parameters
    assert int(units) == 16 + 1             # 16 blocks + root (tied embedding, norm, output)
    assert int(local) * 8 >= int(params) > int(local) * 7   # sharded 8 ways
