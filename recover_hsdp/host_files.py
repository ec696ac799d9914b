"""Where the host-memory state lives and what a listing of it says (plain Python: the
launcher reads it without torch). [Note: host-memory state] (recovery/host_state.py)."""

from __future__ import annotations

import hashlib
import os
import re
import socket
from pathlib import Path
from typing import Iterable

GENERATION = "gen-{step:09d}"
FILE = "r{replica}-s{shard}.pt"
ENTRY = re.compile(r"gen-(\d+)/r(\d+)-s(\d+)\.pt$")


def job_key(dump_folder: str | os.PathLike) -> str:
    """The job's folder name under ``memory_snapshot_dir``: the output folder's name and a hash
    of its real path (the launcher and every rank compute the same one)."""
    path = os.path.realpath(os.fspath(dump_folder))
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(path))[:40] or "job"
    return f"{name}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def job_root(base: str | os.PathLike, dump_folder: str | os.PathLike) -> Path:
    return Path(base) / job_key(dump_folder)


def host_dir(root: str | os.PathLike, host: str | None = None) -> Path:
    """This host's part of the job's folder (``host``: default this host's name)."""
    return Path(root) / (host or socket.gethostname())


def parse_listing(paths: Iterable[str]) -> dict[int, set[int]]:
    """step -> shard positions with a complete file, from paths ending in
    ``gen-<step>/r<replica>-s<shard>.pt`` (a host's listing; temporary files do not match)."""
    found: dict[int, set[int]] = {}
    for path in paths:
        m = ENTRY.search(path.strip())
        if m:
            found.setdefault(int(m.group(1)), set()).add(int(m.group(3)))
    return found


def newest_complete(listings: Iterable[dict[int, set[int]]], shards: int) -> int | None:
    """The newest step whose every shard position ``0 .. shards-1`` has a file on some host of
    ``listings`` (one per surviving host), or None."""
    union: dict[int, set[int]] = {}
    for listing in listings:
        for step, positions in listing.items():
            union.setdefault(step, set()).update(positions)
    complete = [s for s, positions in union.items() if set(range(shards)) <= positions]
    return max(complete, default=None)
