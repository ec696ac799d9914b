"""TrainSpec ``recover_llama3``: TorchTitan's Llama 3 with this project's data and HSDP plan.

Registered through TorchTitan's public ``register_train_spec``; configs select it with
``[model] name = "recover_llama3"``. Differences from the stock ``llama3`` spec:

- flavor ``7B``: the paper's 7B (Llama 2 7B blocks with the Llama 3 vocabulary, untied; the
  3D layout of ``torchtitan_configs/llama3_7b_3d.toml``);
- flavor ``1B``: the Llama 3.2 1B shape (dim 2048, 16 layers, 32 heads, 8 KV heads,
  ffn_dim_multiplier 1.5, multiple_of 256, rope_theta 500000, vocab 128256) with the output
  projection tied to the token embedding as in Llama 3.2 (1.24B parameters; untied 1.50B);
- dataloader/tokenizer: :mod:`recover_hsdp.titan.data` (local corpus on CPU, C4 on clusters);
- pipelining: TorchTitan's own ``pipeline_llm`` (stages of the model's layers, its schedule);
  the loss is TorchTitan's cross-entropy behind a scale the ReCoVer step sets per microbatch
  ([Note: pipeline stages in a replica] in titan/pipeline.py);
- parallelize: TorchTitan's tensor parallelism (when ``tensor_parallel_degree`` > 1), then
  always FSDP2. TorchTitan falls back to DDP when the shard degree is 1, and the MPI path's
  one-rank replica world would get no data parallelism at all; both need FSDP2's all-reduce
  hook / HSDP semantics, so with shard degree 1 the model is wrapped with ``fully_shard`` over a
  (replicate, 1) mesh (stock) or a 1-rank mesh (one-rank replica), taken from TorchTitan's own
  mesh when TP is on (FSDP2 needs the TP and FSDP meshes to share a root).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch.distributed.device_mesh import init_device_mesh
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3 import llama3_args
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchtitan.models.llama3.infra.parallelize import (
    apply_fsdp,
    disable_fsdp_gradient_division,
    parallelize_llama,
)
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer
from torchtitan.protocols.train_spec import register_train_spec
import torchtitan.tools.utils as tt_utils

from recover_hsdp.errors import ConfigError
from recover_hsdp.titan import data
from recover_hsdp.titan.cpu_runtime import use_sum_reduce_scatter_on_gloo
from recover_hsdp.titan.metrics import build_metrics_processor
from recover_hsdp.titan.pipeline import build_microbatch_loss

TRAIN_SPEC_NAME = "recover_llama3"



@dataclass
class RecoverLlamaArgs(TransformerModelArgs):
    tie_word_embeddings: bool = False
    """Share the output projection's weight with the token embedding (Llama 3.2 1B/3B)."""


class RecoverLlama(Transformer):
    """TorchTitan's Llama 3 Transformer, optionally with tied input/output embeddings."""

    def __init__(self, model_args: RecoverLlamaArgs):
        super().__init__(model_args)
        if getattr(model_args, "tie_word_embeddings", False):
            self.output.weight = self.tok_embeddings.weight
        # init_weights() initialises the shared weight last, as the output projection
        # (truncated normal, std dim**-0.5 ~ 0.022 at dim 2048): the usual tied-model init.


RECOVER_LLAMA3_FLAVORS = {
    **llama3_args,
    # a larger CPU model for benchmarks (e.g. the rejoin transfer): dim 512, 8 layers, 26M params
    "cpu_large": RecoverLlamaArgs(dim=512, n_layers=8, n_heads=8, vocab_size=2048,
                                  rope_theta=500000),
    # the paper's 7B (Llama 2 7B blocks: dim 4096, 32 layers, 32 heads, MHA, FFN 11008) with the
    # Llama 3 tokenizer's vocabulary, untied (pipeline stages split the two ends): 7.5B params
    "7B": RecoverLlamaArgs(dim=4096, n_layers=32, n_heads=32, multiple_of=256,
                           rope_theta=500000, vocab_size=128256),
    "1B": RecoverLlamaArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        multiple_of=256, rope_theta=500000, vocab_size=128256, tie_word_embeddings=True,
    ),
}


class _WithoutDataParallel:
    """ParallelDims view with data parallelism off, so parallelize_llama applies TP/AC/compile
    only and leaves FSDP to :func:`parallelize_always_fsdp`."""

    fsdp_enabled = False
    dp_replicate_enabled = False

    def __init__(self, parallel_dims):
        self._dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._dims, name)


def check_model_parallelism(job_config) -> None:
    """One-line refusal of a model/parallelism pair that cannot work (launcher and ranks)."""
    args = RECOVER_LLAMA3_FLAVORS.get(job_config.model.flavor)
    if not getattr(args, "tie_word_embeddings", False):
        return
    par = job_config.parallelism
    for name, why in (
            ("pipeline_parallel_degree", "the pipeline puts the two in different stages"),
            ("tensor_parallel_degree", "TorchTitan's TP plan shards the two as separate "
                                       "parameters (the tie would be lost)")):
        if getattr(par, name) > 1:
            raise ConfigError(
                f"parallelism.{name}={getattr(par, name)} with model.flavor="
                f"{job_config.model.flavor!r}: its output projection is tied to the token "
                f"embedding, and {why}; use {name} = 1 for this flavor, or an untied one")


def parallelize_always_fsdp(model, parallel_dims, job_config):
    """TP/AC/compile as TorchTitan does, then FSDP2 whatever the shard degree."""
    check_model_parallelism(job_config)
    tied = getattr(model.model_args, "tie_word_embeddings", False)
    if parallel_dims.fsdp_enabled and not tied:
        model = parallelize_llama(model, parallel_dims, job_config)
    else:
        model = parallelize_llama(model, _WithoutDataParallel(parallel_dims), job_config)
        _apply_fsdp(model, _data_parallel_mesh(parallel_dims), job_config, tied,
                    parallel_dims.pp_enabled)
    if tt_utils.device_type == "cpu":
        use_sum_reduce_scatter_on_gloo(model)
    return model


def _data_parallel_mesh(parallel_dims):
    """The (replicate, shard) or (shard,) mesh, also when the shard degree is 1."""
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        return parallel_dims.get_mesh(names)
    if parallel_dims.tp_enabled or parallel_dims.pp_enabled:  # the data-parallel dims of
        # TorchTitan's own (pp, dp_replicate, fsdp, tp) mesh: TP's DTensors and FSDP's mesh must
        # share a root mesh, and a stage's FSDP mesh is its slice of it. Its size-1 fsdp dim has
        # a "fake" group, which FSDP2 never calls (at size 1 it copies instead of scattering).
        parallel_dims.get_optional_mesh("pp")  # builds the meshes
        names = ("dp_replicate", "fsdp") if parallel_dims.dp_replicate > 1 else ("fsdp",)
        return parallel_dims._global_meshes["dense"][names]  # no public getter at degree 1
    device_type = tt_utils.device_type  # "cpu" once recover_hsdp.titan.cpu_runtime is installed
    if parallel_dims.dp_replicate > 1:
        return init_device_mesh(device_type, (parallel_dims.dp_replicate, 1),
                                mesh_dim_names=("dp_replicate", "fsdp"))
    return init_device_mesh(device_type, (1,), mesh_dim_names=("fsdp",))


def _apply_fsdp(model, mesh, job_config, tied: bool, pp_enabled: bool) -> None:
    training = job_config.training
    param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
    reduce_dtype = TORCH_DTYPE_MAP[training.mixed_precision_reduce]
    if not tied:
        apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   pp_enabled=pp_enabled, cpu_offload=training.enable_cpu_offload,
                   reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward)
        return
    # Tied embeddings: the shared weight must live in one FSDP unit, so the embedding, final
    # norm and output stay in the root unit; each transformer block is its own unit.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = job_config.parallelism.fsdp_reshard_after_forward != "never"
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    disable_fsdp_gradient_division(model)


def register() -> None:
    """Register ``recover_llama3`` (idempotent) and the ``local_corpus`` dataset."""
    data.register_local_corpus_with_torchtitan("outputs/cache/local_corpus")
    spec = replace(
        llama3_train_spec(),
        model_cls=RecoverLlama,
        model_args=RECOVER_LLAMA3_FLAVORS,
        parallelize_fn=parallelize_always_fsdp,
        pipelining_fn=pipeline_llm,  # TorchTitan's split: [Note: pipeline stages in a replica]
        build_loss_fn=build_microbatch_loss,
        build_dataloader_fn=data.build_dataloader,
        build_tokenizer_fn=data.build_tokenizer,
        build_metrics_processor_fn=build_metrics_processor,
    )
    try:
        register_train_spec(TRAIN_SPEC_NAME, spec)
    except ValueError:  # already registered in this process
        pass
