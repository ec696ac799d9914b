"""One-process oracle: recompute a step's gradient from the data the ledger says was committed
(global microbatch ids in exact mode, stream slot positions in stream mode)."""

from __future__ import annotations

import torch

from conftest import DEBUG_CONFIG


def committed_refs(entry) -> list:
    """The DataRefs a ledger entry committed (every replica's)."""
    from recover_hsdp.workload import DataRef

    return sorted(DataRef(None if entry.mode == "exact" else entry.slots[replica], index)
                  for replica, ids in entry.committed.items() for index in ids)


def _stream_batches(cfg, refs, fsdp_degree: int, slots: int) -> dict:
    """(ref, shard) -> this shard's batch, read from the start of each part on one process."""
    from torchtitan.components.tokenizer import build_hf_tokenizer

    from recover_hsdp.titan.data import open_stream_part
    from recover_hsdp.titan.sources import StreamSource
    from recover_hsdp.workload import DataRef

    tokenizer = build_hf_tokenizer(cfg)
    batches = {}
    for slot in sorted({ref.stream for ref in refs}):
        wanted = {ref.index for ref in refs if ref.stream == slot}
        for shard in range(fsdp_degree):
            source = StreamSource(open_stream_part(cfg, tokenizer), fsdp_rank=shard,
                                  fsdp_degree=fsdp_degree, slots=slots,
                                  local_batch_size=cfg.training.local_batch_size)
            for position in range(max(wanted) + 1):
                ref = DataRef(slot, position)
                batch = source.microbatch(ref)
                source.consume(0, [ref])
                if position in wanted:
                    batches[(tuple(ref), shard)] = batch
    return batches


def recompute_gradient(params: dict[str, torch.Tensor], refs: list, fsdp_degree: int,
                       overrides: list[str] = (), slots: int | None = None
                       ) -> dict[str, torch.Tensor]:
    """Sum over the committed microbatches ``refs`` of each one's gradient (all D FSDP-rank
    parts; TP peers share one), with the loss normalised by the step's nominal token count, exactly
    as the trainer does."""
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
    lbs, seq = cfg.training.local_batch_size, cfg.training.seq_len
    nominal = len(refs) * fsdp_degree * lbs * seq
    stream = refs[0].stream is not None
    if stream:
        batches = _stream_batches(cfg, refs, fsdp_degree, slots)
    else:
        sequences = load_sequences(cfg, tokenizer=None)
    for ref in refs:
        for shard in range(fsdp_degree):
            if stream:
                inputs, labels = batches[(tuple(ref), shard)]
                inputs = inputs["input"]
            else:
                rows = [sequences[i] for i in microbatch_sequence_ids(
                    ref.index, shard, fsdp_degree, lbs)]
                inputs = torch.stack([r[0] for r in rows])
                labels = torch.stack([r[1] for r in rows])
            (loss_fn(model(inputs), labels) / nominal).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}
