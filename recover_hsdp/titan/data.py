"""Data with no network: a local corpus + BPE tokenizer, packed map-style data, the dataloaders.

The CPU default (``training.dataset = "local_corpus"``) builds, on first use and once per cache
directory, a text corpus from the Python standard library sources present on every machine and a
byte-level BPE tokenizer trained on it (HF ``tokenizers``). Both are cached under
``training.dataset_path``; the tokenizer directory doubles as ``model.hf_assets_path``, so
TorchTitan's own ``HuggingFaceTokenizer`` loads it.

[Note: microbatch ids] The tokenized corpus is packed into fixed-length sequences and shuffled
once with a fixed seed, so the dataset is map-style: a global microbatch id ``m`` maps to fixed
tokens, whatever replica computes it. A microbatch is what one replica consumes in one
forward/backward: ``D * local_batch_size`` sequences, ``local_batch_size`` per FSDP rank d of
the replica's D (= S ranks / tensor_parallel_degree, [Note: replica layout] in config/checks.py):

    sequence(m, FSDP rank d, k) = m * D * lbs + d * lbs + k          (k < lbs)

In the failure-free run replica r's g-th microbatch of step t (t from 0) is ``t*B + r*G + g``;
stock HSDP and the MPI path both use that mapping, which is what makes them comparable step by
step, and the ``exact`` data assignment relies on it after failures. Any map-style Hugging Face
dataset (e.g. ``c4_test``, or a local C4-format JSON file registered as a TorchTitan dataset)
is packed the same way: every document tokenised once with the job's tokenizer (BOS + text +
EOS, as TorchTitan does), concatenated and cached under ``job.dump_folder/data_cache``.

:func:`build_dataloader` is the TrainSpec's dataloader: on the MPI path a microbatch source
(``recover_hsdp.titan.sources``, [Note: microbatch sources]); on the stock path TorchTitan's
own loaders (exact: the failure-free iteration of the packed windows; stream: TorchTitan's text
dataloader over R x S parts, which the stream source reads identically per slot).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sysconfig
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from torchtitan.components.dataloader import BaseDataLoader

# microbatch_sequence_ids is re-exported: it is [Note: microbatch ids] below
from recover_hsdp.titan.sources import ExactSource, StreamSource, microbatch_sequence_ids  # noqa: F401
from recover_hsdp.workload import DataRef

LOCAL_CORPUS = "local_corpus"
LOCAL_CORPUS_VOCAB = 2048
CORPUS_BYTES = 3 * 1024 * 1024
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
_FILES = ("corpus.jsonl", "tokenizer.json", "tokenizer_config.json", "tokens.npy")


# ---------------------------------------------------------------------------------------------
# Local corpus + tokenizer (built once per cache dir, under a file lock, atomically)
# ---------------------------------------------------------------------------------------------


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stdlib_documents(max_bytes: int) -> list[str]:
    """Python standard-library sources in a fixed order, up to ``max_bytes`` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return docs


def _train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    return tokenizer


def ensure_local_corpus(cache_dir: str | os.PathLike, vocab_size: int = LOCAL_CORPUS_VOCAB) -> Path:
    """Build (once) the local corpus, tokenizer and packed token stream; return the directory.

    Safe to call from every rank at once: one builds under an exclusive lock, the others wait
    and then find the files. Files appear atomically (written to a temp name, then renamed).
    """
    cache = Path(cache_dir)
    if all((cache / name).exists() for name in _FILES):
        return cache
    with _file_lock(cache.parent / f".{cache.name}.lock"):
        if all((cache / name).exists() for name in _FILES):
            return cache
        cache.mkdir(parents=True, exist_ok=True)
        docs = _stdlib_documents(CORPUS_BYTES)
        tokenizer = _train_tokenizer(docs, vocab_size)
        eos_id = tokenizer.token_to_id(EOS)
        bos_id = tokenizer.token_to_id(BOS)
        stream: list[int] = []
        for encoding in tokenizer.encode_batch(docs):
            stream.append(bos_id)
            stream.extend(encoding.ids)
            stream.append(eos_id)
        config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
                  "add_eos_token": False, "model_max_length": 1 << 20}
        _atomic_write(cache / "corpus.jsonl",
                      "".join(json.dumps({"text": d}) + "\n" for d in docs))
        _atomic_write(cache / "tokenizer.json", tokenizer.to_str())
        _atomic_write(cache / "tokenizer_config.json", json.dumps(config))
        tmp = cache / "tokens.tmp.npy"
        np.save(tmp, np.asarray(stream, dtype=np.int32))
        os.replace(tmp, cache / "tokens.npy")
    return cache


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def register_local_corpus_with_torchtitan(default_path: str) -> None:
    """Make ``local_corpus`` a dataset of TorchTitan's own text-dataset registry too."""
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def _load(path: str):
        ensure_local_corpus(path)
        return load_dataset("json", data_files=str(Path(path) / "corpus.jsonl"), split="train")

    DATASETS[LOCAL_CORPUS] = DatasetConfig(
        path=default_path, loader=_load, sample_processor=lambda sample: sample["text"]
    )


# ---------------------------------------------------------------------------------------------
# Indexable packed dataset and the microbatch dataloader
# ---------------------------------------------------------------------------------------------


class PackedSequences:
    """Map-style view of a token stream as shuffled fixed-length (input, label) sequences."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0):
        self.tokens = tokens
        self.seq_len = seq_len
        count = (len(tokens) - 1) // seq_len
        if count < 1:
            raise ValueError(
                f"training.seq_len={seq_len} is longer than the whole corpus "
                f"({len(tokens)} tokens): lower training.seq_len"
            )
        self.order = np.random.RandomState(seed).permutation(count)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.order[index % len(self.order)]) * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class MicrobatchDataLoader(ExactSource):
    """The exact source as stock TorchTitan's loader (the same windows per microbatch id).

    ``batch(m)`` returns this rank's part of microbatch ``m``. Iterating yields the
    failure-free sequence of microbatches for this replica (what stock TorchTitan consumes):
    step t, accumulation step g -> ``t*B + replica*G + g`` with ``B = replicas * G``.
    Its checkpointable state is the number of whole steps consumed, so a job resumed with a
    different G (fewer replicas, same global batch) continues at the same global position.
    """

    def __init__(self, sequences: PackedSequences, *, replica: int, replicas: int, fsdp_rank: int,
                 fsdp_degree: int, local_batch_size: int, microbatches_per_replica: int):
        super().__init__(sequences, fsdp_rank=fsdp_rank, fsdp_degree=fsdp_degree,
                         local_batch_size=local_batch_size)
        self.replica, self.replicas = replica, replicas
        self.microbatches_per_replica = microbatches_per_replica
        self.consumed = 0

    def batch(self, microbatch_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self.microbatch(DataRef(None, microbatch_id))

    def failure_free_id(self, position: int) -> int:
        step, g = divmod(position, self.microbatches_per_replica)
        global_batch = self.replicas * self.microbatches_per_replica
        return step * global_batch + self.replica * self.microbatches_per_replica + g

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            microbatch_id = self.failure_free_id(self.consumed)
            self.consumed += 1
            yield self.batch(microbatch_id)

    def state_dict(self) -> dict[str, Any]:
        return {"steps_consumed": self.consumed // self.microbatches_per_replica}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.consumed = int(state_dict["steps_consumed"]) * self.microbatches_per_replica


def load_sequences(job_config, tokenizer) -> PackedSequences:
    """The packed windows of the job's map-style dataset (exact mode)."""
    if job_config.training.dataset == LOCAL_CORPUS:
        tokens = np.load(ensure_local_corpus(job_config.training.dataset_path) / "tokens.npy",
                         mmap_mode="r")
    else:
        tokens = np.load(pack_dataset(job_config, tokenizer), mmap_mode="r")
    return PackedSequences(tokens, job_config.training.seq_len,
                           seed=job_config.recover.workload.data_seed)


def _dataset_entry(job_config):
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from recover_hsdp.errors import ConfigError

    name = job_config.training.dataset
    if name not in DATASETS:
        raise ConfigError(f"training.dataset={name!r} is not a registered TorchTitan text dataset: "
                          f"use one of {', '.join(sorted(DATASETS))}")
    entry = DATASETS[name]
    return entry, job_config.training.dataset_path or entry.path


def pack_dataset(job_config, tokenizer) -> Path:
    """Tokenise a map-style dataset once (BOS + text + EOS per document, in dataset order) into
    one int32 token file; cached per (dataset, path, tokenizer) under the run's folder, built by
    one rank per host under a lock, written atomically."""
    from datasets import Dataset

    from recover_hsdp.errors import ConfigError

    entry, path = _dataset_entry(job_config)
    assets = Path(job_config.model.hf_assets_path or ".") / "tokenizer.json"
    fingerprint = hashlib.sha256(assets.read_bytes() if assets.is_file() else b"").hexdigest()
    key = hashlib.sha256(json.dumps([job_config.training.dataset, str(Path(path).resolve()),
                                     fingerprint]).encode()).hexdigest()[:16]
    target = Path(job_config.job.dump_folder) / "data_cache" / f"{job_config.training.dataset}-{key}.npy"
    if target.exists():
        return target
    with _file_lock(target.with_suffix(".lock")):
        if target.exists():
            return target
        dataset = entry.loader(path)
        if not isinstance(dataset, Dataset):
            raise ConfigError(
                f"recover.workload.data_assignment=exact needs a map-style dataset and "
                f"training.dataset={job_config.training.dataset!r} loads as a stream "
                f"({type(dataset).__name__}): use data_assignment = \"stream\"")
        stream: list[int] = []
        for sample in dataset:
            stream.extend(tokenizer.encode(entry.sample_processor(sample), add_bos=True,
                                           add_eos=True))
        tmp = target.with_suffix(".tmp.npy")
        np.save(tmp, np.asarray(stream, dtype=np.int32))
        os.replace(tmp, target)
    return target


def open_stream_part(job_config, tokenizer):
    """``(part, parts) -> TorchTitan HuggingFaceTextDataset`` of the job's dataset (infinite)."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    _dataset_entry(job_config)  # a clear error for an unknown name

    def open_part(part: int, parts: int):
        return HuggingFaceTextDataset(
            dataset_name=job_config.training.dataset, dataset_path=job_config.training.dataset_path,
            tokenizer=tokenizer, seq_len=job_config.training.seq_len, dp_rank=part,
            dp_world_size=parts, infinite=True)

    return open_part


def build_tokenizer(job_config):
    """TorchTitan tokenizer builder: builds the local tokenizer first when it is the dataset."""
    from torchtitan.components.tokenizer import build_hf_tokenizer

    if job_config.training.dataset == LOCAL_CORPUS:
        ensure_local_corpus(job_config.training.dataset_path)
    return build_hf_tokenizer(job_config)


def resolve_replica_layout(job_config, dp_world_size: int, dp_rank: int) -> tuple[int, int, int, int]:
    """(replicas R, this replica r, FSDP degree D, this FSDP rank d) for a data-parallel rank
    (TorchTitan's data-parallel world: tensor-parallel peers share a rank, [Note: replica layout]).

    Stock HSDP: TorchTitan's data-parallel world is all R*D ranks, rank = r*D + d. MPI path:
    TorchTitan only sees the replica's D data-parallel ranks; r comes from the MPI bootstrap and
    R is W_init, the stream slots (``recover.initial_replicas``, else the launched count).
    """
    if job_config.recover.enable:
        from recover_hsdp.config import initial_replica_count
        from recover_hsdp.groups.bootstrap import current_placement  # MPI path only

        layout = current_placement()  # W_init stream slots: [Note: the relaunch keeps B]
        return (initial_replica_count(job_config.recover.initial_replicas, layout.replicas),
                layout.replica, dp_world_size, dp_rank)
    shard_degree = job_config.parallelism.data_parallel_shard_degree
    replicate = job_config.parallelism.data_parallel_replicate_degree
    if shard_degree < 1:
        shard_degree = dp_world_size // max(replicate, 1)
    replica, shard = divmod(dp_rank, shard_degree)
    return dp_world_size // shard_degree, replica, shard_degree, shard


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config) -> BaseDataLoader:
    """TorchTitan dataloader builder (TrainSpec.build_dataloader_fn).

    Stock HSDP passes the whole data-parallel world (R*D ranks, rank = r*D + d). The MPI path
    passes only the replica's data-parallel world (D ranks; D = S without tensor parallelism);
    the replica id then comes from the MPI bootstrap.
    """
    from recover_hsdp.config import microbatches_per_replica

    replicas, replica, fsdp_degree, fsdp_rank = resolve_replica_layout(
        job_config, dp_world_size, dp_rank)
    lbs = job_config.training.local_batch_size
    stream = job_config.recover.workload.data_assignment == "stream"
    if job_config.recover.enable:  # the MPI path: [Note: microbatch sources]
        if stream:
            return StreamSource(open_stream_part(job_config, tokenizer), fsdp_rank=fsdp_rank,
                                fsdp_degree=fsdp_degree, slots=replicas,
                                local_batch_size=lbs)
        return ExactSource(load_sequences(job_config, tokenizer), fsdp_rank=fsdp_rank,
                           fsdp_degree=fsdp_degree, local_batch_size=lbs)
    if stream:  # stock TorchTitan: its own text dataloader over the R x D parts
        from torchtitan.hf_datasets.text_datasets import build_text_dataloader

        return build_text_dataloader(replicas * fsdp_degree,
                                     replica * fsdp_degree + fsdp_rank, tokenizer, job_config)
    return MicrobatchDataLoader(
        load_sequences(job_config, tokenizer), replica=replica, replicas=replicas,
        fsdp_rank=fsdp_rank, fsdp_degree=fsdp_degree, local_batch_size=lbs,
        microbatches_per_replica=microbatches_per_replica(
            lbs, job_config.training.global_batch_size, replicas * fsdp_degree),
    )
