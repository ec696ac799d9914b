"""A local C4-format dataset built in the test (no network), and the one-process data oracle.

``make_local_c4(folder)`` writes what a cluster user gets from ``allenai/c4`` (the ``en``
config): ``README.md`` with the dataset card's ``configs`` section and gzipped JSON-lines files
``en/c4-train.0000N-of-0000M.json.gz`` whose records have ``text``, ``timestamp`` and ``url``.
TorchTitan's ``c4`` dataset reads it as a Hugging Face streaming ``IterableDataset``
(``training.dataset_path = folder``); ``c4_test`` reads the same folder as a map-style Arrow
dataset. The texts are the local corpus's documents cut into paragraphs.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

from conftest import CACHE, read_jsonl

README = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: "en/c4-train.*.json.gz"
  - split: validation
    path: "en/c4-validation.*.json.gz"
---
# C4 (local test copy)
"""


def make_local_c4(folder: Path, train_files: int = 4, docs_per_file: int = 150) -> Path:
    from recover_hsdp.titan.data import ensure_local_corpus

    corpus = ensure_local_corpus(CACHE) / "corpus.jsonl"
    paragraphs = [p for line in corpus.read_text().splitlines()
                  for p in json.loads(line)["text"].split("\n\n") if len(p) > 200]
    folder = Path(folder)
    (folder / "en").mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(README)
    n = 0
    for split, files in (("train", train_files), ("validation", 1)):
        for f in range(files):
            name = folder / "en" / f"c4-{split}.{f:05d}-of-{files:05d}.json.gz"
            with gzip.open(name, "wt", encoding="utf-8") as handle:
                for _ in range(docs_per_file):
                    text = paragraphs[n % len(paragraphs)]
                    handle.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:00:00Z",
                                             "url": f"https://example.org/{split}/{n}"}) + "\n")
                    n += 1
    return folder


def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from recover_hsdp.titan.data import ensure_local_corpus

    return HuggingFaceTokenizer(str(ensure_local_corpus(CACHE)))


def stream_windows(dataset: str, path: Path, part: int, parts: int, seq_len: int, count: int):
    """The first ``count`` (input) windows of one data-parallel part, read on one process with
    TorchTitan's own tokenise-and-pack, as CRC-32s."""
    import zlib

    import torch
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from recover_hsdp.titan import model_spec

    model_spec.register()  # local_corpus in TorchTitan's registry
    ds = HuggingFaceTextDataset(dataset, str(path), tokenizer(), seq_len=seq_len, dp_rank=part,
                                dp_world_size=parts, infinite=True)
    out, it = [], iter(ds)
    for _ in range(count):
        window = next(it)[0]["input"]
        out.append(zlib.crc32(window.to(torch.int64).numpy().tobytes()))
    return out


def audit_stream_samples(runs: list[tuple[Path, int | None]], dataset: str, path: Path,
                         seq_len: int, local_batch_size: int) -> dict[int, int]:
    """Check what stream-mode ranks logged they committed (``samples/``), across runs.

    ``runs``: (output folder, last step of it that counts) in order (a restart's first run
    counts up to its checkpoint). Every (part, position) is committed once, positions of a part
    are contiguous from 0, and every logged window equals the one-process oracle's.
    Returns part -> positions committed."""
    seen: dict[int, dict[int, list[int]]] = defaultdict(dict)
    parts = None
    for out, last in runs:
        for log in sorted((out / "samples").glob("rank*.jsonl")):
            for line in read_jsonl(log):
                if last is not None and line["step"] > last:
                    continue
                part, parts, first = line["sequences"]
                position = line["ref"][1]
                assert position not in seen[part], f"part {part} position {position} twice"
                assert first == position * local_batch_size
                seen[part][position] = line["crc32"]
    for part, positions in seen.items():
        count = len(positions)
        assert sorted(positions) == list(range(count)), f"part {part}: holes {sorted(positions)}"
        oracle = stream_windows(dataset, path, part, parts, seq_len, count * local_batch_size)
        for position, crcs in positions.items():
            expected = oracle[position * local_batch_size:(position + 1) * local_batch_size]
            assert crcs == expected, f"part {part} position {position}: data differs"
    return {part: len(positions) for part, positions in seen.items()}
