"""Host-memory state: each rank's shard of the training state, kept on its own host.

[Note: host-memory state] HSDP keeps every replica's copy of the same shards bitwise equal, so
after a node is lost the surviving replicas' hosts still hold every byte of the model and the
optimizer state: a relaunch needs no shared filesystem and no DCP checkpoint to redo nothing
(after a cut link) or at most ``recover.tiers.memory_snapshot_interval`` steps (after a host
killed with its daemon). What is kept, where, and when:

* **What**: one file per rank and generation: its parameter shards and optimizer state tensors
  (the same list a rejoin's donor sends: ``join_tensors``), the LR schedulers, the loader state
  (stream mode: every replica's, gathered as for a checkpoint), the optimizer's param groups,
  the step, the tokens seen and the workload policy (B, G, roles, stream cursors), plus an exact
  checksum of the tensors ([Note: exact fingerprints] in recovery/fingerprint.py).
* **Where**: ``<memory_snapshot_dir>/<job key>/<host name>/gen-<step>/r<replica>-s<shard>.pt``
  (``job_root``, ``host_dir`` in recover_hsdp/host_files.py): host-local memory by default
  (``/dev/shm``), which outlives the rank's process but not its host. The host name level keeps
  each host's copies apart when the directory is shared (a network filesystem, or the namespace
  cluster of the tests, where every "node" sees one ``/dev/shm``): a rank reads only its own
  host's.
* **When**: every ``memory_snapshot_interval`` steps and at the emergency boundary (a host lost
  as a whole: [Note: emergency checkpoint] in manager/manager.py), at the step boundary, the
  same step on every rank. The state is copied to host memory on the step's critical path (one
  ``clone`` on a CPU, a device-to-host copy on a GPU), then written by a background thread
  (:class:`Snapshotter`) while the next steps train; an emergency generation is written and
  agreed before the launcher is told.
* **Always one complete generation**: a file is written under a temporary name and renamed (a
  reader never sees half a file), and a rank removes its older generations only once a newer one
  of its own is written, keeping the last two (:data:`KEEP`): ranks may be one generation apart
  when a failure stops them mid-write, and the older of the two is then complete on every rank.
* **Who resumes from it**: the launcher lists the surviving hosts' files (over mpirun's agent)
  and relaunches from the newest step for which every shard position has a file on some
  surviving host (``newest_complete`` in recover_hsdp/host_files.py), or from the newest
  certified DCP checkpoint when that is newer ([Note: the relaunch tier] in cli/relaunch.py). A
  relaunched rank reads its own host's copy of its shard position (any replica's: they are
  equal); a rank on a standby or replaced host gets it from a rank of its shard position that
  has it, over the job's fault-tolerant world at start-up: point to point from one donor per
  position to the ranks without a copy (``RecoverManager.share_state``), so the bytes on the
  network are one file per rank that lacks one, whatever the replica count (an all-gather
  would hand every file to every replica: R - 1 copies, in every rank's memory); who holds
  what is gathered over the whole world, so every rank runs the same rounds even where its
  position needs nothing (with round-robin numbering a replica's ranks sit on several hosts, and
  positions differ); a donor lost meanwhile is replaced by the next holder after the repair.
  Each file's checksum is verified on read, and the replicas agree that their loaded states are
  equal, before a step is trained.
* **Cleaned**: the launcher removes the job's folder on every host it reaches when the run ends
  (whatever ends it) and before a relaunch from anything older; at a normal end the ranks
  remove their host's part after the run's last agreement (dead ranks' files there too).

Cost: host memory of :data:`KEEP` generations per rank (x its shard of parameters + optimizer
state) plus one in-flight copy; the copy's time on the critical path per snapshot
(benchmarks/relaunch_bench.py measures it; the default interval comes from it). The writer says
at the end of a run what its generations cost it (``HostState.cost_line`` in
titan/host_state.py): the figures to set the interval from on the user's own hardware.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from recover_hsdp.host_files import ENTRY, FILE, GENERATION
from recover_hsdp.recovery.fingerprint import fingerprint

KEEP = 2  # generations a rank keeps: [Note: host-memory state]


def checksum(tensors: list[torch.Tensor]) -> int:
    return fingerprint(tensors, layout_free=True)


class HostStateStore:
    """One rank's generations on its host (:func:`host_dir`). ``replica``/``shard``: the
    rank's place in the job (its file's name)."""

    def __init__(self, directory: str | os.PathLike, replica: int, shard: int):
        self.directory, self.replica, self.shard = Path(directory), replica, shard

    def path(self, step: int, replica: int | None = None, shard: int | None = None) -> Path:
        return self.directory / GENERATION.format(step=step) / FILE.format(
            replica=self.replica if replica is None else replica,
            shard=self.shard if shard is None else shard)

    def write(self, step: int, payload: dict[str, Any]) -> Path:
        """Write ``step``'s file (temporary name, then renamed) and prune older generations."""
        final = self.path(step)
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            torch.save(payload, temporary)
            os.replace(temporary, final)
        finally:
            temporary.unlink(missing_ok=True)
        self.prune()
        return final

    def own_steps(self) -> list[int]:
        """Steps of this rank's complete files, newest first."""
        return sorted((s for s, _ in self._own()), reverse=True)

    def _own(self) -> list[tuple[int, Path]]:
        name = FILE.format(replica=self.replica, shard=self.shard)
        return [(int(g.name[4:]), g / name) for g in self._generations() if (g / name).exists()]

    def _generations(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return [g for g in self.directory.iterdir() if g.is_dir() and g.name.startswith("gen-")
                and g.name[4:].isdigit()]

    def prune(self, keep: int = KEEP) -> None:
        """Remove this rank's files but the newest ``keep``, and generation folders left empty."""
        for _, path in sorted(self._own(), reverse=True)[keep:]:
            path.unlink(missing_ok=True)
        for generation in self._generations():
            try:
                generation.rmdir()  # only if empty
            except OSError:
                pass

    def find(self, step: int) -> Path | None:
        """A complete file of ``step`` for this rank's shard position on this host (its own
        replica's first, else any replica's: they are equal)."""
        own = self.path(step)
        if own.exists():
            return own
        folder = own.parent
        if not folder.is_dir():
            return None
        others = sorted(p for p in folder.iterdir()
                        if (m := ENTRY.search(f"{folder.name}/{p.name}")) and
                        int(m.group(3)) == self.shard)
        return others[0] if others else None

    def remove_own(self) -> None:
        for _, path in self._own():
            path.unlink(missing_ok=True)
        self.prune()


def read_payload(source: Path | bytes | memoryview) -> tuple[dict[str, Any] | None, str | None]:
    """(payload, None) if ``source`` (a file or its bytes) loads and its tensors match its
    checksum, else (None, why: one line)."""
    try:
        data = io.BytesIO(source) if isinstance(source, (bytes, memoryview)) else source
        payload = torch.load(data, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - a torn or foreign file is refused, not fatal
        return None, f"unreadable ({type(err).__name__}: {str(err)[:120]})"
    if not isinstance(payload, dict) or "tensors" not in payload:
        return None, "not a host-state file"
    if checksum(payload["tensors"]) != payload.get("checksum"):
        return None, "checksum mismatch (a byte changed after it was written)"
    return payload, None


class Snapshotter:
    """Copies a rank's state at a step boundary and writes it on a background thread.

    :meth:`submit` waits for the previous write (at most one in flight: the host memory of one
    copy), copies ``tensors`` to host memory (a clone on a CPU, a device-to-host copy on a GPU:
    the only part on the step's critical path) and hands the file to the thread; ``wait=True``
    (the emergency boundary) writes before it returns. :meth:`wait` returns the last write's
    error (one line) or None. What it cost is kept: ``waited_s`` (for a write still in flight)
    and ``copy_s`` on the critical path, ``written_s`` in the background, ``bytes`` per copy."""

    def __init__(self, store: HostStateStore):
        self.store = store
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self.last_written: int | None = None
        self.waited_s = self.copy_s = self.written_s = 0.0
        self.bytes = 0

    def submit(self, step: int, tensors: list[torch.Tensor], meta: dict[str, Any],
               wait: bool = False) -> str | None:
        started = time.perf_counter()
        previous = self.wait()
        copied = time.perf_counter()
        self.waited_s += copied - started
        with torch.no_grad():
            copies = [t.detach().to("cpu", copy=True) for t in tensors]
        self.copy_s += time.perf_counter() - copied
        self.bytes = sum(t.numel() * t.element_size() for t in copies)
        payload = {"step": step, "replica": self.store.replica, "shard": self.store.shard,
                   "meta": meta, "tensors": copies}
        self._thread = threading.Thread(target=self._write, args=(step, payload),
                                        name="recover-hsdp-host-state", daemon=True)
        self._thread.start()
        return self.wait() if wait else previous

    def _write(self, step: int, payload: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            payload["checksum"] = checksum(payload["tensors"])
            self.store.write(step, payload)
            self.last_written = step
        except Exception as err:  # noqa: BLE001 - reported by wait(); training goes on
            self._error = f"host-state write of step {step}: {type(err).__name__}: {err}"
        finally:
            self.written_s += time.perf_counter() - started

    def wait(self) -> str | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error


def remove_tree(root: str | os.PathLike) -> None:
    shutil.rmtree(root, ignore_errors=True)
