"""Probe (issue 22 item 5): a real Slurm (Debian bookworm's slurmctld/slurmd 22.05) on the
namespace cluster of tests/netns_cluster.py: slurmctld on node 0, one slurmd per node (node name =
the namespace's hostname), auth/none. Usage: python slurm_cluster.py [COMMAND...]: runs COMMAND
(default: srun -N <nodes> hostname) on node 0 inside the cluster, then tears everything down.
Environment: PROBE_NODES (4), PROBE_PREFIX (rhsl), PROBE_SUBNET (10.231.91)."""

import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from netns_cluster import NetnsCluster  # noqa: E402

N = int(os.environ.get("PROBE_NODES", "4"))
PREFIX = os.environ.get("PROBE_PREFIX", "rhsl")
SUBNET = os.environ.get("PROBE_SUBNET", "10.231.91")
ROOT = Path(os.environ.get("PROBE_DIR", f"/tmp/{PREFIX}-slurm"))
COMMAND_FOR = None     # callable(cluster) -> argv (slurm_relaunch.py), else sys.argv / srun
BEFORE_COMMAND = None  # callable(cluster), run right before the command


def conf(cluster: NetnsCluster) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=2 State=UNKNOWN"
                      for n, a in zip(cluster.names, cluster.addrs))
    return f"""ClusterName={PREFIX}
SlurmctldHost={cluster.names[0]}({cluster.addrs[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={ROOT}/ctld
SlurmdSpoolDir={ROOT}/d-%n
SlurmctldPidFile={ROOT}/ctld.pid
SlurmdPidFile={ROOT}/d-%n.pid
SlurmctldLogFile={ROOT}/ctld.log
SlurmdLogFile={ROOT}/d-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
InactiveLimit=0
KillWait=5
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


def main() -> int:
    shutil.rmtree(ROOT, ignore_errors=True)
    (ROOT / "ctld").mkdir(parents=True)
    with NetnsCluster(N, prefix=PREFIX, subnet=SUBNET) as cluster:
        path = ROOT / "slurm.conf"
        path.write_text(conf(cluster))
        (ROOT / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                                          "IgnoreSystemd=yes\nConstrainCores=no\n"
                                          "ConstrainRAMSpace=no\nConstrainDevices=no\n")
        env = {"SLURM_CONF": str(path)}
        hosts = Path("/etc/hosts").read_text()
        Path("/etc/hosts").write_text(hosts + "".join(
            f"{a} {n}  # {PREFIX} probe\n" for n, a in zip(cluster.names, cluster.addrs)))
        try:
            daemons = [cluster.popen(0, ["slurmctld", "-D", "-i", "-f", str(path)], env=env)]
            time.sleep(1.0)
            for i, name in enumerate(cluster.names):
                (ROOT / f"d-{name}").mkdir(exist_ok=True)
                daemons.append(cluster.popen(i, ["slurmd", "-D", "-N", name, "-f", str(path)],
                                             env=env))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                out = cluster.run(0, ["sinfo", "-h", "-o", "%T %D"], env=env).stdout.split()
                if out[:2] == ["idle", str(N)]:
                    break
                time.sleep(0.5)
            print("sinfo:", out, flush=True)
            command = (COMMAND_FOR(cluster) if COMMAND_FOR else
                       sys.argv[1:] or ["srun", "-N", str(N), "hostname"])
            if BEFORE_COMMAND:
                BEFORE_COMMAND(cluster)
            started = time.monotonic()
            result = cluster.run(0, command, env=env, timeout=float(os.environ.get("PROBE_TIMEOUT", "60")))
            print(f"rc={result.returncode} in {time.monotonic() - started:.1f}s\n"
                  f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}", flush=True)
            return result.returncode
        finally:
            for d in daemons:
                d.kill()
            Path("/etc/hosts").write_text(hosts)


if __name__ == "__main__":
    sys.exit(main())
