"""Microbatch sources: the data of a ``DataRef`` on the MPI path (the trainer's dataloader).

[Note: microbatch sources] The manager asks for microbatches by reference
(``recover_hsdp.workload.DataRef``), never by "next": a survivor computes extras, a spare
computes what it may never commit, a restart continues elsewhere. Two sources, one interface
(:class:`MicrobatchSource`), chosen by ``recover.workload.data_assignment``:

  ExactSource   map-style data (the local corpus; a Hugging Face Arrow dataset of local files)
                tokenised once, packed into fixed windows and shuffled ([Note: microbatch
                ids] in data.py): ``DataRef(None, m)`` is global microbatch m, whoever
                computes it, so survivors take over a dead replica's exact ids.
  StreamSource  any TorchTitan text dataset read as a stream (Hugging Face streaming
                ``IterableDataset`` such as C4, or map-style), with TorchTitan's own
                tokenise-and-pack (``HuggingFaceTextDataset``): the dataset is split into
                W_init x S disjoint parts; ``DataRef(slot, p)`` is the p-th microbatch
                (``local_batch_size`` windows) of this rank's part of stream slot ``slot``
                ([Note: stream slots] in workload/policy.py). Positions are read in order;
                positions read but not committed (a spare's) stay cached and are served
                again; a forward jump (a slot resumed at its cursor from an older state) is
                replayed without caching.

After each committed step the trainer calls ``consume`` with this replica's committed refs: the
stream source releases them, and with ``recover.debug.log_samples`` each rank writes what it
committed to ``samples/rank<N>.jsonl`` (ref, sequence ids, CRC-32 of each sequence's tokens),
so tests can check every committed sequence against data recomputed on one process.

Checkpoints: a stream's state at its cursor (the packing buffer and the dataset's own resume
state, e.g. the Hugging Face shard and offset) is gathered from every replica when a checkpoint
is due (``RecoverManager.gather_for_checkpoint``) and written by the saving replica into
TorchTitan's DCP checkpoint under ``dataloader`` (``shard<s>of<S>``: every slot's state for
FSDP rank s of S). A slot whose replica died keeps its last gathered state.
"""

from __future__ import annotations

import copy
import json
import pickle
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torchtitan.components.dataloader import BaseDataLoader

from recover_hsdp.workload import DataRef

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


def microbatch_sequence_ids(microbatch_id: int, fsdp_rank: int, fsdp_degree: int,
                            local_batch_size: int) -> range:
    """Sequence indices one shard rank feeds for a microbatch ([Note: microbatch ids] in
    data.py)."""
    first = (microbatch_id * fsdp_degree + fsdp_rank) * local_batch_size
    return range(first, first + local_batch_size)


class SampleLog:
    """``samples/rank<N>.jsonl``: one line per committed microbatch of this rank."""

    def __init__(self, out_dir: str | Path, world_rank: int):
        folder = Path(out_dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / f"rank{world_rank}.jsonl", "a", encoding="utf-8")

    def write(self, step: int, ref: DataRef, sequences: Sequence[int] | None, batch: Batch):
        inputs = batch[0]["input"]
        crcs = [zlib.crc32(row.to(torch.int64).numpy().tobytes()) for row in inputs]
        self._file.write(json.dumps({"step": step, "ref": list(ref), "sequences": sequences,
                                     "crc32": crcs}) + "\n")
        self._file.flush()


class MicrobatchSource(BaseDataLoader):
    """What the RecoverTrainer reads microbatches from ([Note: microbatch sources])."""

    sample_log: SampleLog | None = None
    gathers_state = False
    """Whether every replica's ``checkpoint_state`` must be gathered before a checkpoint."""

    def microbatch(self, ref: DataRef) -> Batch:
        """This rank's part (``local_batch_size`` sequences) of the microbatch at ``ref``."""
        raise NotImplementedError

    def consume(self, step: int, refs: Iterable[DataRef]) -> None:
        """The replica committed ``refs`` in ``step``."""

    def checkpoint_state(self) -> Any:
        """This rank's loader state at its cursor, to be gathered for a checkpoint (None: the
        workload policy's state suffices)."""
        return None

    def set_gathered(self, states: Iterable[Any]) -> None:
        """Every replica's ``checkpoint_state`` (this shard's), before a checkpoint is written."""

    def __iter__(self):
        raise TypeError("a MicrobatchSource is addressed by DataRef (microbatch()), not iterated")


class ExactSource(MicrobatchSource):
    """Global microbatch ids over packed, shuffled, fixed windows ([Note: microbatch ids])."""

    def __init__(self, sequences, *, fsdp_rank: int, fsdp_degree: int, local_batch_size: int):
        self.sequences, self.fsdp_rank = sequences, fsdp_rank
        self.fsdp_degree, self.local_batch_size = fsdp_degree, local_batch_size

    def _ids(self, microbatch: int) -> range:
        return microbatch_sequence_ids(microbatch, self.fsdp_rank, self.fsdp_degree,
                                       self.local_batch_size)

    def microbatch(self, ref: DataRef) -> Batch:
        if ref.stream is not None:
            raise ValueError(f"{ref}: the exact source serves global microbatch ids only")
        rows = [self.sequences[i] for i in self._ids(ref.index)]
        return {"input": torch.stack([r[0] for r in rows])}, torch.stack([r[1] for r in rows])

    def consume(self, step: int, refs: Iterable[DataRef]) -> None:
        if self.sample_log is not None:
            for ref in refs:
                self.sample_log.write(step, ref, list(self._ids(ref.index)),
                                      self.microbatch(ref))

    def state_dict(self) -> dict[str, Any]:
        return {}  # the policy's step is the position: step t commits ids t*B .. t*B+B-1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class _SlotReader:
    """Sequential reader of one stream slot's part for this rank: ``local_batch_size``
    windows per position, with the dataset's resume state before each position."""

    def __init__(self, dataset, local_batch_size: int):
        self.dataset, self.local_batch_size = dataset, local_batch_size
        self.position = 0
        self._rows = None

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "dataset": copy.deepcopy(self.dataset.state_dict())}

    def restore(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(copy.deepcopy(state["dataset"]))
        self.position, self._rows = int(state["position"]), None

    def read(self) -> Batch:
        if self._rows is None:
            self._rows = iter(self.dataset)
        rows = [next(self._rows) for _ in range(self.local_batch_size)]
        self.position += 1
        return ({"input": torch.stack([r[0]["input"] for r in rows])},
                torch.stack([r[1] for r in rows]))


class StreamSource(MicrobatchSource):
    """Stream slots of a TorchTitan text dataset ([Note: microbatch sources]).

    Args:
        open_part: ``(part, parts) -> dataset``: TorchTitan's ``HuggingFaceTextDataset`` of
            data-parallel part ``part`` of ``parts`` (infinite).
        fsdp_rank: this rank's FSDP rank d in its replica; slot k's part is ``k * D + d``
            (its tensor-parallel peers read the same part: [Note: replica layout]).
        fsdp_degree: D, the replica's FSDP degree (S ranks / tensor_parallel_degree).
        slots: W_init, the number of stream slots (a checkpoint's own value replaces it).
        local_batch_size: windows per microbatch on this rank.
    """

    gathers_state = True

    def __init__(self, open_part: Callable[[int, int], Any], *, fsdp_rank: int,
                 fsdp_degree: int, slots: int, local_batch_size: int):
        self._open_part = open_part
        self.fsdp_rank, self.fsdp_degree = fsdp_rank, fsdp_degree
        self.slots, self.local_batch_size = slots, local_batch_size
        self.slot: int | None = None
        self.cursor = 0
        self.replayed = 0  # positions read only to reach a cursor (a resumed slot)
        self._reader: _SlotReader | None = None
        self._cache: dict[int, tuple[dict[str, Any], Batch]] = {}
        self._saved: dict[int, dict[str, Any]] = {}  # slot -> state at its cursor

    def _open(self, slot: int, position: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"stream slot {slot} outside 0..{self.slots - 1}")
        parts = self.slots * self.fsdp_degree
        self._reader = _SlotReader(self._open_part(slot * self.fsdp_degree + self.fsdp_rank,
                                                   parts), self.local_batch_size)
        if slot in self._saved:
            self._reader.restore(self._saved[slot])
        self.slot, self.cursor, self._cache = slot, position, {}

    def microbatch(self, ref: DataRef) -> Batch:
        slot, position = ref
        if slot is None:
            raise ValueError(f"{ref}: the stream source serves stream slot positions only")
        if slot != self.slot:  # first use, or a restart mapped this replica to another slot
            self._open(slot, position)
        if position in self._cache:
            return self._cache[position][1]
        reader = self._reader
        if position < reader.position:
            raise RuntimeError(f"stream slot {slot}: position {position} was consumed already "
                               f"(reader at {reader.position}): data would be read twice")
        while reader.position < position:  # a slot resumed from an older state: replay
            reader.read()
            self.replayed += 1
        before = reader.state()
        batch = reader.read()
        self._cache[position] = (before, batch)
        return batch

    def consume(self, step: int, refs: Iterable[DataRef]) -> None:
        positions = sorted(ref.index for ref in refs if ref.stream == self.slot)
        if not positions:
            return
        if positions != list(range(self.cursor, self.cursor + len(positions))):
            raise RuntimeError(f"stream slot {self.slot}: committed positions {positions} "
                               f"are not contiguous from the cursor {self.cursor}")
        if self.sample_log is not None:
            part, parts = self.slot * self.fsdp_degree + self.fsdp_rank, \
                self.slots * self.fsdp_degree
            for position in positions:
                self.sample_log.write(step, DataRef(self.slot, position),
                                      [part, parts, position * self.local_batch_size],
                                      self._cache[position][1])
        self.cursor = positions[-1] + 1
        self._cache = {p: v for p, v in self._cache.items() if p >= self.cursor}

    def checkpoint_state(self) -> dict[str, Any] | None:
        if self.slot is None:
            return None
        if self.cursor in self._cache:
            state = self._cache[self.cursor][0]
        elif self._reader.position == self.cursor:
            state = self._reader.state()
        else:
            raise RuntimeError(f"stream slot {self.slot}: no loader state at cursor "
                               f"{self.cursor} (reader at {self._reader.position})")
        return {"slot": self.slot, **state}

    def set_gathered(self, states: Iterable[Any]) -> None:
        for state in states:
            if state is not None:
                self._saved[int(state["slot"])] = {k: v for k, v in state.items() if k != "slot"}

    def state_dict(self) -> dict[str, Any]:
        return {self._key: pickle.dumps({"version": 1, "slots": self.slots,
                                         "states": self._saved})}

    @property
    def _key(self) -> str:
        """Per FSDP rank, and per S: the states of S ranks split a slot S ways (a restart with
        another S finds no key: DCP names the missing one instead of reading wrong parts)."""
        return f"shard{self.fsdp_rank}of{self.fsdp_degree}"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blob = state_dict.get(self._key) if state_dict else None
        if blob is None:
            return
        state = pickle.loads(blob)
        self.slots, self._saved = int(state["slots"]), dict(state["states"])
        self.slot, self._reader, self._cache = None, None, {}
