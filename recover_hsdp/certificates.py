"""Checkpoint certificates: which ``step-N`` folders a restart may load.

[Note: certified checkpoints] A DCP folder whose ``.metadata`` exists is complete, not right: it
may hold a replica's diverged state (saved before a vote could see it) or bytes storage changed
afterwards. So every save is certified: once the survivors agree it is complete ([Note: a
checkpoint the survivors agree on] in manager/between_steps.py) every alive replica takes the
exact fingerprint of its state (parameters and optimizer state, [Note: exact fingerprints] in
recovery/fingerprint.py, its S ranks' summed: the sum is free of the layout), the replicas vote
([Note: divergence votes] in manager/divergence.py) and, when the saving replica holds the
strict majority's state (or is alone), the writer writes ``recover_certificate.json`` into the
folder: the agreed fingerprints and whether the folder is a restart point (TorchTitan's
``last_save_model_only`` makes the last save hold the model only: not a restart point). A
restart or a relaunch loads only certified restart points, newest first; once loaded, every
replica fingerprints what it loaded and the load is agreed only if every replica's equals the
certificate's; one that does not verify (or does not load) is refused in one line and the next
older certified one is tried (titan/trainer.py, ``ReplicaCheckpointer.load``). A folder without
a certificate (a writer lost between the save and the certificate, an older version) is skipped
the same way. What it cannot see: corruption of the state before the save that every replica
shares (a wrong reduced gradient is everyone's), and a certificate changed together with its
folder.

This module is the one place that knows the file's name and contents (standard library only:
the launcher reads it too, cli/relaunch.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from recover_hsdp.handshake import write_json_atomic

CERTIFICATE = "recover_certificate.json"
FOLDER = re.compile(r"^step-(\d+)$")


@dataclass
class Certificate:
    """What a certified save records.

    Attributes:
        step: the step saved.
        restart_point: the folder holds the full train state (False: a model-only save).
        state_fingerprint: the agreed fingerprint of a replica's parameters and optimizer state
            (its ranks' summed, 16 hex digits).
        replicas: each alive replica's fingerprint at the save (hex), the vote's input.
        ranks_per_replica: S of the job that saved it.
    """

    step: int
    restart_point: bool
    state_fingerprint: str
    replicas: dict[str, str] = field(default_factory=dict)
    ranks_per_replica: int = 1


def write(folder: str | Path, certificate: Certificate) -> None:
    write_json_atomic(Path(folder) / CERTIFICATE, asdict(certificate))


def read(folder: str | Path) -> Certificate | None:
    """The folder's certificate, or None (none, or not readable: not certified)."""
    try:
        record = json.loads((Path(folder) / CERTIFICATE).read_text())
        return Certificate(**record)
    except (OSError, ValueError, TypeError):
        return None


def complete_checkpoints(root: str | Path | None) -> list[int]:
    """Steps of the ``step-N`` folders under ``root`` that hold their ``.metadata``, newest
    first."""
    if root is None or not Path(root).is_dir():
        return []
    return sorted((int(m.group(1)) for p in Path(root).iterdir()
                   if p.is_dir() and (m := FOLDER.match(p.name))
                   and (p / ".metadata").is_file()), reverse=True)


def why_not_restart_point(folder: str | Path) -> str | None:
    """None when ``folder`` is a certified restart point, else why not (a few words)."""
    certificate = read(folder)
    if certificate is None:
        return "no certificate (not agreed complete and verified when it was saved)"
    if not certificate.restart_point:
        return "model-only (checkpoint.last_save_model_only): not a restart point"
    return None


def restart_points(root: str | Path | None, below: int | None = None) -> list[int]:
    """Certified restart points under ``root``, newest first (only steps < ``below``)."""
    return [s for s in complete_checkpoints(root)
            if (below is None or s < below) and why_not_restart_point(folder_of(root, s)) is None]


def newest_restart_point(root: str | Path | None) -> int | None:
    points = restart_points(root)
    return points[0] if points else None


def folder_of(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step}"
