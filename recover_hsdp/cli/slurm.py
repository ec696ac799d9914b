"""Inside a Slurm allocation: the allocation's nodes as the job's hostfile.

[Note: Slurm allocations] ``recover-hsdp train`` inside an allocation (``sbatch`` / ``salloc``)
needs no hostfile: the launcher writes one from the allocation (``SLURM_JOB_NODELIST``, slots
from ``SLURM_TASKS_PER_NODE``) into the output folder and passes it to mpirun, whose PRRTE
starts its daemons through Slurm (``plm/slurm``: ``srun``) within the allocation. The hostfile
is what keeps the relaunch tier ([Note: the relaunch tier] in cli/relaunch.py) inside the
allocation: a relaunch uses the allocation's nodes minus the lost ones, and nodes the job did not
use are its standby nodes. The launcher reaches the nodes (the liveness probe, ending an old
job's processes) with ``srun --overlap`` on one node instead of ssh. PRRTE's own ``srun`` (the
step that starts its daemons) gets ``--overlap`` too (``--prtemca plm_slurm_args --overlap``,
unless the caller set ``plm_slurm_args``): after a node is lost, the old job's daemon step cannot
complete while one of its nodes is dead, it keeps the live nodes' CPUs, and the relaunch's
daemon step waited for them forever (measured on a real Slurm 22.05, one slurmd per namespace
node: docs/probes/slurm22/). Run against that Slurm: ``salloc --no-kill`` (without it Slurm ends
the whole allocation when a node fails), 3 replicas on 4 nodes, a node SIGKILLed with its
slurmd, prted and rank after step 3: the relaunch ran on the other 3 nodes (the standby one
included) from step 2 and completed 12 steps, B every step.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from recover_hsdp.cli.hostfile import HostEntry, format_hostfile
from recover_hsdp.errors import ConfigError

NODELIST = "SLURM_JOB_NODELIST"
TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
#: How the launcher runs a command on one node of the allocation (hosts.py appends the node).
SRUN_AGENT = ["srun", "--nodes=1", "--ntasks=1", "--overlap", "--quiet", "--nodelist"]


def prted_step_overlaps(mpi_args: list[str]) -> list[str]:
    """``mpi_args`` plus ``--prtemca plm_slurm_args --overlap`` ([Note: Slurm allocations]),
    unless they set ``plm_slurm_args`` already."""
    if "plm_slurm_args" in mpi_args or os.environ.get("PRTE_MCA_plm_slurm_args"):
        return mpi_args
    return [*mpi_args, "--prtemca", "plm_slurm_args", "--overlap"]


def in_allocation(environ=os.environ) -> bool:
    return bool(environ.get(NODELIST))


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_one(expr: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", expr)
    if match is None:
        return [expr]
    head, tail = expr[:match.start()], expr[match.end():]
    names = []
    for item in match.group(1).split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in {expr!r}")
        for number in range(int(lo), int(hi or lo) + 1):
            names.append(f"{head}{number:0{len(lo)}d}")
    return [name for prefix in names for name in _expand_one(prefix + tail)]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list (``gpu-[001-003,007],login1``) as host names, in order."""
    return [name for expr in _split_top(text) for name in _expand_one(expr)]


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``4(x3),2``) as one count per node, in node order."""
    counts = []
    for item in _split_top(text):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if match is None:
            raise ValueError(f"bad item {item!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def allocation_hosts(environ=os.environ) -> list[HostEntry]:
    """The allocation's nodes as hostfile entries (slots: its tasks per node, when given)."""
    try:
        names = expand_nodelist(environ[NODELIST])
        slots = (expand_tasks_per_node(environ[TASKS_PER_NODE])
                 if environ.get(TASKS_PER_NODE) else [])
    except ValueError as err:
        raise ConfigError(f"{NODELIST}={environ.get(NODELIST)!r} / {TASKS_PER_NODE}="
                          f"{environ.get(TASKS_PER_NODE)!r}: cannot read the Slurm allocation "
                          f"({err}); pass --hostfile instead") from None
    if slots and len(slots) != len(names):
        slots = []  # a step's layout, not the allocation's: let mpirun decide
    entries = []
    for index, name in enumerate(names):
        count = slots[index] if slots else None
        line = f"{name} slots={count}" if count else name
        entries.append(HostEntry(name, line, count))
    return entries


def write_allocation_hostfile(out: Path, environ=os.environ) -> Path:
    """The allocation as a hostfile in ``out`` ([Note: Slurm allocations]); returns its path."""
    path = Path(out) / "slurm-hostfile"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_hostfile(allocation_hosts(environ)))
    return path
