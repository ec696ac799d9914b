"""Reaching the job's hosts the way mpirun does: its ssh-like agent (``plm_ssh_agent``).

The relaunch tier ([Note: the relaunch tier], ``recover_hsdp.cli.relaunch``) asks every host
of the hostfile for its host name (a host that does not answer within a few seconds is lost;
the name maps PRRTE's messages and procs.json to hostfile lines) and, before a relaunch, ends
every process of the old job still alive there (pid + start time, as
``ProcessInfo.kill`` does locally: a reused pid is never hit). All hosts are asked at once.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

from recover_hsdp.cli import slurm

PROBE_TIMEOUT_S = 10.0


def ssh_agent(mpi_args: list[str], environ=os.environ) -> list[str]:
    """The agent command mpirun uses: ``--prtemca plm_ssh_agent A`` in the mpirun arguments,
    else ``PRTE_MCA_plm_ssh_agent``, else inside a Slurm allocation ``srun`` on one node
    ([Note: Slurm allocations] in cli/slurm.py), else ``ssh`` (PRRTE's default)."""
    for index, arg in enumerate(mpi_args[:-2]):
        if arg in ("--prtemca", "--mca") and mpi_args[index + 1] == "plm_ssh_agent":
            return shlex.split(mpi_args[index + 2])
    if "PRTE_MCA_plm_ssh_agent" not in environ and slurm.in_allocation(environ):
        return list(slurm.SRUN_AGENT)
    return shlex.split(environ.get("PRTE_MCA_plm_ssh_agent", "ssh").split(":")[0])


SSH_CONNECT_TIMEOUT_S = 5
"""ssh's ``ConnectTimeout`` for the launcher's own calls when the agent sets none: a host cut
off answers no TCP handshake, and without it ssh waits for the kernel's SYN retries (~2 min on
Linux), so a probe would only end at its own timeout (10 s, then 20 s); a live host's kernel
answers the handshake at once however loaded the host is."""


def agent_argv(agent: list[str], host: str, command: str) -> list[str]:
    """The command line that runs the shell ``command`` on ``host`` through ``agent`` (ssh
    hands a string to the remote shell; srun runs an argv). An ssh agent is given
    :data:`SSH_CONNECT_TIMEOUT_S` and ``BatchMode`` (never a prompt) unless it sets them."""
    name = os.path.basename(agent[0])
    if name == "srun":
        return [*agent, host, "sh", "-c", command]
    if name == "ssh":
        given = " ".join(agent[1:]).lower()
        agent = [*agent,
                 *([] if "connecttimeout" in given
                   else ["-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]),
                 *([] if "batchmode" in given else ["-o", "BatchMode=yes"])]
    return [*agent, host, command]


def _remote(agent: list[str], host: str, command: str, timeout: float) -> str | None:
    """stdout of ``command`` run on ``host`` through the agent, None if it failed or timed out."""
    if host in ("localhost", "127.0.0.1", socket.gethostname()):
        argv = ["sh", "-c", command]
    else:
        argv = agent_argv(agent, host, command)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def host_names(agent: list[str], hosts: list[str],
               timeout: float = PROBE_TIMEOUT_S) -> dict[str, str | None]:
    """hostfile name -> the host name it reports (``hostname``), None when it did not answer
    twice: a host that misses the first probe is asked again with twice the time (a loaded host
    is slow to start a process, and a host wrongly called lost costs a relaunch)."""
    answers = _ask(agent, hosts, timeout)
    silent = [h for h, name in answers.items() if name is None]
    if silent:
        answers.update(_ask(agent, silent, 2 * timeout))
    return answers


def _ask(agent: list[str], hosts: list[str], timeout: float) -> dict[str, str | None]:
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        answers = pool.map(lambda h: _remote(agent, h, "hostname", timeout), hosts)
        return {h: (a.strip() or None) if a is not None else None for h, a in zip(hosts, answers)}


_KILL = ("for ps in {specs}; do p=${{ps%%:*}}; s=${{ps##*:}}; "
         "[ -r /proc/$p/stat ] || continue; "
         "[ \"$(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f1)\" = Z ] && continue; "
         "[ \"$(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f20)\" = \"$s\" ] || continue; "
         "kill -9 $p 2>/dev/null && echo $p; done; true")


def kill_remote(agent: list[str], by_host: dict[str, list[tuple[int, int]]],
                timeout: float = PROBE_TIMEOUT_S) -> dict[str, list[int]]:
    """SIGKILL the (pid, start time) processes on each host that are still those processes;
    returns host -> pids signalled (hosts that did not answer are left out)."""
    jobs = {h: _KILL.format(specs=" ".join(f"{pid}:{start}" for pid, start in procs))
            for h, procs in by_host.items() if procs}
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(jobs))) as pool:
        answers = dict(zip(jobs, pool.map(lambda h: _remote(agent, h, jobs[h], timeout), jobs)))
    return {h: [int(p) for p in a.split() if p.isdigit()] for h, a in answers.items()
            if a is not None}


def list_host_state(agent: list[str], hosts: list[str], root: str,
                    timeout: float = PROBE_TIMEOUT_S) -> dict[str, list[str] | None]:
    """host -> the host-memory files of the job under ``root`` on it, in its own host-name
    folder ([Note: host-memory state] in recovery/host_state.py); None if it did not answer."""
    command = f"find {shlex.quote(root)}/\"$(hostname)\" -name '*.pt' 2>/dev/null; true"
    return _on_hosts(agent, hosts, command, timeout,
                     lambda out: [line for line in out.splitlines() if line.strip()])


def remove_host_state(agent: list[str], hosts: list[str], root: str,
                      timeout: float = PROBE_TIMEOUT_S) -> dict[str, bool]:
    """Remove the job's host-memory folder ``root`` on every host (and here); host -> done."""
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    command = f"rm -rf {shlex.quote(root)}; true"
    return {h: out is not None
            for h, out in _on_hosts(agent, hosts, command, timeout, lambda out: out).items()}


def _on_hosts(agent, hosts, command, timeout, parse):
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        answers = pool.map(lambda h: _remote(agent, h, command, timeout), hosts)
        return {h: (parse(a) if a is not None else None) for h, a in zip(hosts, answers)}
