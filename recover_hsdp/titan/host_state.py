"""``HostState``: the trainer's host-memory generations ([Note: host-memory state] in
recovery/host_state.py): what a rank writes at a step boundary and how a relaunched rank
loads it (its own host's copy, else a peer's), verified and agreed before it trains."""

from __future__ import annotations

import time

import torch

from recover_hsdp.errors import ConfigError
from recover_hsdp.host_files import host_dir, job_root
from recover_hsdp.recovery.host_state import (HostStateStore, Snapshotter, read_payload,
                                              remove_tree)
from recover_hsdp.recovery.staging import to_host


class HostState:
    """Args:
        trainer: the ``RecoverTrainer`` (its state: ``_join_state``, ``join_meta``,
            ``state_dict``; its manager's agreements).
        tiers: ``job_config.recover.tiers``; dump_folder: ``job.dump_folder``.
    """

    def __init__(self, trainer, tiers, dump_folder: str):
        self.trainer, self.manager = trainer, trainer.manager
        self.interval = tiers.memory_snapshot_interval
        self.root = job_root(tiers.memory_snapshot_dir, dump_folder)
        self.store = HostStateStore(host_dir(self.root), self.manager.replica, self.manager.shard)
        self.snapshotter = Snapshotter(self.store)
        self.generations = 0
        self.critical_s = 0.0  # snapshot() on the step's critical path, the emergency's too
        self._first: float | None = None

    @property
    def on(self) -> bool:
        return self.interval > 0

    def due(self, step: int, last_step: bool) -> bool:
        return self.on and not last_step and step % self.interval == 0

    # ---------------------------------------------------------------- write

    def snapshot(self, step: int, wait: bool = False) -> bool:
        """This rank's generation of ``step`` (the same step on every rank). ``wait`` (the
        emergency boundary): written and agreed written on every rank before it returns;
        else copied now and written in the background. Returns whether it is known written."""
        started = time.perf_counter()
        self._first = self._first or started
        try:
            return self._snapshot(step, wait)
        finally:
            self.generations += 1
            self.critical_s += time.perf_counter() - started

    def _snapshot(self, step: int, wait: bool) -> bool:
        trainer = self.trainer
        source = trainer.dataloader
        if getattr(source, "gathers_state", False):  # stream mode: every replica's positions
            states = self.manager.gather_for_checkpoint(to_host(source.checkpoint_state()))
            source.set_gathered(states.values())
        self.store.replica = self.manager.replica  # ids change with a relaunch onto fewer
        meta = to_host({"train_state": trainer.state_dict(), "join": trainer.join_meta()})
        error = self.snapshotter.submit(step, trainer._join_state(), meta, wait=wait)
        if not wait:
            if error:
                self._say(f"step {step}: {error}")
            return False
        errors = sorted({e for e in self.manager.gather_global(error or "", "host state")
                         if e})
        if errors:
            self._say(f"step {step}: host-memory generation NOT written everywhere: {errors[0]}")
        return not errors

    def drain(self) -> None:
        """The write in flight is done (before the run's last agreement)."""
        self.snapshotter.wait()

    def finish(self) -> None:
        """A normal end, after the run's last agreement (every rank has drained): this host's
        part of the job's folder goes, the files of ranks that died here too (the launcher
        removes the job's folder on every host it reaches as well)."""
        self.snapshotter.wait()
        if self.generations and self.manager.is_writer:
            print(self.cost_line(), flush=True)
        remove_tree(self.store.directory)
        try:
            self.root.rmdir()  # the last host's to finish, where the folder is shared
        except OSError:
            pass

    def cost_line(self) -> str:
        """What the generations cost this rank, said once at the end by the writer: the
        figures a user sets ``memory_snapshot_interval`` from."""
        snap = self.snapshotter
        span = time.perf_counter() - self._first if self._first else 0.0
        share = f" ({100 * self.critical_s / span:.2f}% of the time since the first)" \
            if span > 0 else ""
        return (f"[recover-hsdp] host-memory state: {self.generations} generation(s) every "
                f"{self.interval} step(s), {snap.bytes / 2**20:.1f} MiB per rank; on the step's "
                f"critical path {self.critical_s:.3f} s{share} (copy {snap.copy_s:.3f} s, "
                f"waiting for the previous write {snap.waited_s:.3f} s), written in the "
                f"background {snap.written_s:.3f} s")

    # ---------------------------------------------------------------- load

    def restore(self, step: int) -> None:
        """Load ``step``'s generation into this rank ([Note: host-memory state]): this host's
        copy of its shard position, else the copy of a rank of the same position that has one
        (sent point to point over the world's shard communicator); checksum verified, then
        every rank agrees the load succeeded and that the replicas hold equal state. Raises
        ``ConfigError`` (one line) if any rank could not."""
        manager, shard = self.manager, self.manager.shard
        path = self.store.find(step)
        payload, why = read_payload(path) if path else (None, "no copy on this host")
        # a rank without a copy gets one from a holder of its shard position, point to point
        data, orphans = manager.share_state(payload is not None, lambda: path.read_bytes())
        fetched = False
        if data is not None:
            payload, why = read_payload(memoryview(data))
            fetched = payload is not None
        elif payload is None and shard in orphans:
            why = f"{why}; no rank of this shard position holds it"
        error = why and f"replica {manager.replica} shard {shard}: {why}"
        if payload is not None and not error:
            error = self._apply(payload, step)
        fingerprint = None if error else self.trainer.state_fingerprint()
        results = manager.gather_global((error or "", shard, fingerprint, fetched),
                                        "host state load")
        errors = sorted({e for e, _, _, _ in results if e})
        by_shard: dict[int, set] = {}
        for _, position, value, _ in results:
            by_shard.setdefault(position, set()).add(value)
        if not errors and any(len(v) > 1 for v in by_shard.values()):
            errors = ["the replicas' loaded states differ"]
        if errors:
            raise ConfigError(f"recover.tiers.resume_from_memory={step}: the host-memory "
                              f"generation does not load ({errors[0]}): relaunch from a "
                              "checkpoint (checkpoint.enable) or from step 0")
        from_peer = sum(1 for *_, peer in results if peer)
        if manager.is_writer:
            print(f"[recover-hsdp] resumed from the host-memory generation of step {step}: "
                  f"{len(results)} rank(s) verified, {from_peer} of them from a peer's copy",
                  flush=True)
        manager.outputs.log_event({"phase": "host state load", "step": step,
                                   "epoch": manager.world.epoch, "ranks": len(results),
                                   "from_peer": from_peer})

    def _apply(self, payload: dict, step: int) -> str | None:
        trainer = self.trainer
        if payload.get("step") != step:
            return f"the file holds step {payload.get('step')}, not {step}"
        targets = trainer._join_state()  # the optimizer's state exists from here on
        saved = payload["tensors"]
        if len(saved) != len(targets) or any(
                s.shape != t.shape or s.dtype != t.dtype for s, t in zip(saved, targets)):
            return "its tensors do not match this rank's (another model or layout)"
        with torch.no_grad():
            for target, source in zip(targets, saved):
                target.copy_(source)
        meta = payload["meta"]
        trainer.apply_join_meta(meta["join"])
        trainer.load_state_dict(dict(meta["train_state"]))
        return None

    def _say(self, line: str) -> None:
        print(f"[recover-hsdp] replica {self.manager.replica} shard {self.manager.shard}: {line}",
              flush=True)
