"""``LocalProcesses``: every world rank's process, and ending the excluded ones on this host.

[Note: nothing left behind] (recover_hsdp/collectives/processes.py) says why a rank excluded from
the world is not always dead (a frozen process keeps its memory, its sockets and mpirun) and why
the survivors on its host end it. This part owns the process table (from the bootstrap; grown
by a rejoin) and does the ending.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from recover_hsdp.collectives.guard import log_line
from recover_hsdp.collectives.processes import (ProcessInfo, StoppedPeers, kill_local,
                                                write_registry)


class LocalProcesses:
    """The process of every world rank, indexed by world rank.

    Args:
        world: the ``World`` (collectives/interface.py).
        procs: every world rank's ``ProcessInfo`` (empty in in-process tests: nothing to end).
    """

    def __init__(self, world, procs: Sequence[ProcessInfo] = ()):
        self.world = world
        self.table: list[ProcessInfo] = list(procs)

    def watch_stopped(self, after_s: float) -> None:
        """While a guarded call of this rank waits, end the job's processes on this host that
        stay stopped ``after_s`` ([Note: stopped peers outside the detector] in
        collectives/processes.py); 0: never. Runs on the world's watchdog thread."""
        if after_s <= 0:
            return
        watch = StoppedPeers(after_s)
        deadlines = getattr(self.world, "deadlines", None)
        contiguous_s = 2 * (deadlines.effective_poll_s if deadlines else 1.0) + 1.0

        def on_blocked(now: float) -> None:
            local = [p for p in self.table if p.is_local()]
            for proc in watch.sweep(local, now, contiguous_s):
                if proc.kill():
                    rank = self.table.index(proc)
                    log_line(f"world rank {self.world.world_rank}: ended world rank {rank} "
                             f"(pid {proc.pid}), stopped for {after_s:g} s on this host while "
                             "this rank waited on it ([Note: stopped peers outside the "
                             "detector])")

        self.world.on_blocked = on_blocked

    def end_failed(self, ranks: list[int]) -> None:
        """Ranks a failed MPI call reported: end at once those frozen on this host. A frozen
        rank keeps its sockets open, so its replica peers stay blocked in an intra-replica
        collective (and, through their shard communicators, the other replicas) until it really
        dies; its death frees them now instead of at their hang watchdog."""
        self._end(ranks, frozen_only=True)

    def end_excluded(self, frozen_only: bool = True) -> None:
        """SIGKILL the processes of excluded replicas that run on this host. After a repair
        only frozen ones (stopped: they will never move); at the end of the run every one still
        there (a rank of a dead replica retires by itself within its grace period, so it is not
        killed while it leaves)."""
        alive = set(self.world.layout.alive_ranks())
        self._end([r for r in range(len(self.table)) if r not in alive], frozen_only)

    def hosts_emptied(self) -> set[str]:
        """Hosts whose every rank is out of the world now and was not at the last call: a host
        lost as a whole ([Note: emergency checkpoint] in manager/manager.py). The same on every
        rank (the table and the alive set are agreed)."""
        alive = set(self.world.layout.alive_ranks())
        hosts: dict[str, bool] = {}
        for rank, proc in enumerate(self.table):
            hosts[proc.host] = hosts.get(proc.host, False) or rank in alive
        empty = {h for h, any_alive in hosts.items() if not any_alive}
        new, self._empty = empty - getattr(self, "_empty", set()), empty
        return new

    def place(self, world_ranks: Sequence[int], processes: Sequence[ProcessInfo]) -> None:
        """Newcomers joined as ``world_ranks`` ([Note: rejoin at a boundary])."""
        for world_rank, process in zip(world_ranks, processes):
            while len(self.table) <= world_rank:
                self.table.append(process)
            self.table[world_rank] = process

    def write_registry(self, out_dir: str | Path) -> None:
        write_registry(out_dir, self.table)

    def _end(self, ranks, frozen_only: bool) -> None:
        procs = [self.table[r] for r in ranks if r < len(self.table)]
        killed = kill_local([p for p in procs if p.is_frozen()] if frozen_only else procs)
        if killed:
            print(f"[recover-hsdp] rank {self.world.world_rank}: ended "
                  f"{'frozen ' if frozen_only else ''}processes of ranks out of the world "
                  f"{killed} on this host", flush=True)
