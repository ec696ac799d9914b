"""[Note: Slurm allocations] (recover_hsdp/cli/slurm.py): the allocation read as a hostfile and
the srun agent, in-process. No real Slurm here (no slurmctld / slurmd packages on this machine)."""

import pytest

from recover_hsdp.cli import hosts, slurm
from recover_hsdp.config import ConfigError


@pytest.mark.parametrize("text,names", [
    ("node1", ["node1"]),
    ("gpu-[001-003,007],login1", ["gpu-001", "gpu-002", "gpu-003", "gpu-007", "login1"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[3],y", ["x3", "y"]),
])
def test_nodelist_expands_in_order(text, names):
    assert slurm.expand_nodelist(text) == names


def test_tasks_per_node_expands():
    assert slurm.expand_tasks_per_node("4(x3),2") == [4, 4, 4, 2]
    assert slurm.expand_tasks_per_node("8") == [8]


def test_allocation_becomes_a_hostfile(tmp_path):
    env = {"SLURM_JOB_NODELIST": "gpu-[01-03]", "SLURM_TASKS_PER_NODE": "8(x3)"}
    assert slurm.in_allocation(env) and not slurm.in_allocation({})
    path = slurm.write_allocation_hostfile(tmp_path, env)
    assert path.read_text() == "gpu-01 slots=8\ngpu-02 slots=8\ngpu-03 slots=8\n"
    mismatched = slurm.allocation_hosts({"SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "2"})
    assert [(e.name, e.slots) for e in mismatched] == [("a", None), ("b", None)]


def test_a_bad_nodelist_is_one_line_naming_the_variable():
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST.*pass --hostfile") as info:
        slurm.allocation_hosts({"SLURM_JOB_NODELIST": "n[1-x]"})
    assert "\n" not in str(info.value)


def test_inside_an_allocation_the_launcher_reaches_nodes_through_srun():
    env = {"SLURM_JOB_NODELIST": "n[1-2]"}
    agent = hosts.ssh_agent([], env)
    assert agent[0] == "srun" and "--overlap" in agent
    assert hosts.agent_argv(agent, "n2", "hostname")[-4:] == ["n2", "sh", "-c", "hostname"]
    assert hosts.ssh_agent([], {}) == ["ssh"]
    # ssh: a cut-off host fails the handshake in seconds, never a prompt; the user's own
    # options win
    assert hosts.agent_argv(["ssh"], "n2", "hostname") == [
        "ssh", "-o", f"ConnectTimeout={hosts.SSH_CONNECT_TIMEOUT_S}", "-o", "BatchMode=yes",
        "n2", "hostname"]
    assert hosts.agent_argv(["/usr/bin/ssh", "-o", "ConnectTimeout=20"], "n2", "true") == [
        "/usr/bin/ssh", "-o", "ConnectTimeout=20", "-o", "BatchMode=yes", "n2", "true"]
    explicit = ["--prtemca", "plm_ssh_agent", "/x/agent.sh", "-np"]
    assert hosts.ssh_agent(explicit, env) == ["/x/agent.sh"]   # an explicit agent wins


def test_prteds_step_overlaps_the_lost_jobs_step(monkeypatch):
    """[Note: Slurm allocations]: PRRTE's srun gets --overlap (the old job's daemon step, stuck
    on a dead node, holds the live nodes' CPUs), unless the caller chose plm_slurm_args."""
    from recover_hsdp.cli.slurm import prted_step_overlaps

    monkeypatch.delenv("PRTE_MCA_plm_slurm_args", raising=False)
    assert prted_step_overlaps(["--map-by", "ppr:1:node"]) == [
        "--map-by", "ppr:1:node", "--prtemca", "plm_slurm_args", "--overlap"]
    own = ["--prtemca", "plm_slurm_args", "--exclusive"]
    assert prted_step_overlaps(own) == own
    monkeypatch.setenv("PRTE_MCA_plm_slurm_args", "--exclusive")
    assert prted_step_overlaps([]) == []
