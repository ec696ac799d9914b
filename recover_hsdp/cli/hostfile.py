"""Open MPI hostfiles: read (``--hostfile``, the relaunch tier's hosts, ``--stock``'s first
host) and written (a relaunch's hosts, a Slurm allocation's nodes) in one place.

A line is a host name, then options (``slots=N``, ``max_slots=N``); ``#`` starts a comment. An
entry keeps its line as given, so a hostfile written from entries says what the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostEntry:
    """One line of an Open MPI hostfile: the name mpirun is given, its line, its slots."""

    name: str
    line: str
    slots: int | None = None


def parse_hostfile(text: str) -> list[HostEntry]:
    """The hosts of an Open MPI hostfile, in order (comments dropped, ``slots=`` read)."""
    entries = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        slots = next((int(w.split("=", 1)[1]) for w in words[1:]
                      if w.startswith(("slots=", "max_slots=")) and w.split("=", 1)[1].isdigit()),
                     None)
        entries.append(HostEntry(words[0], line, slots))
    return entries


def read_hostfile(path: str | Path) -> list[HostEntry]:
    """:func:`parse_hostfile` of the file at ``path``."""
    return parse_hostfile(Path(path).read_text())


def hostfile_hosts(path: str | Path) -> list[str]:
    """The host names of the hostfile at ``path``, in order."""
    return [entry.name for entry in read_hostfile(path)]


def format_hostfile(entries: list[HostEntry]) -> str:
    """The hostfile of ``entries``, one line each as it was given."""
    return "".join(f"{e.line}\n" for e in entries)
