"""One-process oracle: recompute a step's gradient from the microbatch ids in the ledger."""

from __future__ import annotations

import torch

from conftest import DEBUG_CONFIG


def recompute_gradient(params: dict[str, torch.Tensor], committed_ids: list[int],
                       ranks_per_replica: int, overrides: list[str] = ()) -> dict[str, torch.Tensor]:
    """Sum over ``committed_ids`` of each microbatch's gradient (all S shard slices), with the
    loss normalised by the step's nominal token count, exactly as the trainer does."""
    from recover_hsdp.titan import cpu_runtime, model_spec
    from recover_hsdp.titan.data import load_sequences, microbatch_sequence_ids

    cpu_runtime.install()
    model_spec.register()
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = ConfigManager().parse_args(["--job.config_file", str(DEBUG_CONFIG), *overrides])
    spec = get_train_spec(cfg.model.name)
    args = spec.model_args[cfg.model.flavor]
    args.update_from_config(cfg)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.load_state_dict(params)
    loss_fn = spec.build_loss_fn(cfg)
    sequences = load_sequences(cfg, tokenizer=None)
    lbs, seq = cfg.training.local_batch_size, cfg.training.seq_len
    nominal = len(committed_ids) * ranks_per_replica * lbs * seq
    for microbatch in committed_ids:
        for shard in range(ranks_per_replica):
            rows = [sequences[i] for i in microbatch_sequence_ids(microbatch, shard,
                                                                  ranks_per_replica, lbs)]
            inputs = torch.stack([r[0] for r in rows])
            labels = torch.stack([r[1] for r in rows])
            (loss_fn(model(inputs), labels) / nominal).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}
