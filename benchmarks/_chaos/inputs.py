"""Every cost and setting the chaos simulator uses, each with where it comes from.

A value is read from the project's measured results (``benchmarks/results/*.json``), from the
project's config defaults (``recover_hsdp/config/sections.py``) or from its 1B config
(``torchtitan_configs/llama3_1b_hsdp.toml``); where none has it, it is a constant stated here
with its reason, and the output JSON says so (``source`` starts with "constant").

The measured seconds come from a tiny model on a 2-core CPU box (benchmarks/README.md); what
changes with a large model on GPUs is the job's start-up (a restart), taken at the paper's scale
(10 minutes), as ``projection.py``'s paper-scale scenario does.
"""

from __future__ import annotations

import json
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
CONFIG_1B = REPO / "torchtitan_configs" / "llama3_1b_hsdp.toml"
REPLICAS_1B = 8   # the 1B config's layout: 8 replicas x 8 ranks (its header comment)

# The stated constants (no results file has them); each input's source says where it is used.
JOIN_STARTUP_S = 60.0    # a GPU model's start-up before a replacement can join (projection.py)
RESTART_S = 600.0        # a job restart at scale: the paper's ~10 minutes
CR_HANG_S = 100.0        # TorchTitan 0.2.2's comm.train_timeout_seconds default
FTHSDP_STALL_S = 180.0   # FT-HSDP's published stall per failure at O(100K) GPUs
REPAIR_HOURS = 24.0      # a failed node back in the standby pool


@dataclass(frozen=True)
class Value:
    """One input and where it comes from."""

    value: float
    source: str


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _median(values) -> float:
    return statistics.median([v for v in values if v is not None])


def config_default(section: str, name: str, fallback):
    """A field's default from the project's config dataclasses (``recover.<section>.<name>``),
    or ``fallback`` (said in the source) if the config no longer has it."""
    try:
        from recover_hsdp.config import sections

        cls = next(c for c in vars(sections).values()
                   if isinstance(c, type) and getattr(c, "NAME", None) == section)
        return Value(getattr(cls(), name), f"recover_hsdp/config/sections.py: recover.{section}."
                                           f"{name} default")
    except (ImportError, StopIteration, AttributeError, TypeError):
        return Value(fallback, f"constant {fallback!r}: recover.{section}.{name} not found in "
                               "the config")


def step_inputs() -> dict[str, Value]:
    """The step: per-microbatch time, failure-free step, G_init, tokens per microbatch."""
    model = _json("gpu_step_model.json")["step_s"]["1B on 8 x 8 (G = 4)"]
    cfg = tomllib.loads(CONFIG_1B.read_text())
    training, ranks = cfg["training"], cfg["recover"]["ranks_per_replica"]
    per_replica = ranks * training["local_batch_size"]
    g_init = training["global_batch_size"] // (REPLICAS_1B * per_replica)
    stock = model["stock HSDP (NCCL, reduce every microbatch, overlapped)"]
    ours = model["ReCoVer torch plane NCCL, overlapped (default)"]
    src = "benchmarks/results/gpu_step_model.json (a model, not a measurement), 1B on 8 x 8"
    return {
        "g_init": Value(g_init, f"{CONFIG_1B.relative_to(REPO)}: global_batch_size / "
                                f"({REPLICAS_1B} replicas x ranks_per_replica x local_batch_size)"),
        "replica_gpus": Value(ranks, f"{CONFIG_1B.relative_to(REPO)}: recover.ranks_per_replica"),
        "tokens_per_microbatch": Value(per_replica * training["seq_len"],
                                       f"{CONFIG_1B.relative_to(REPO)}: ranks_per_replica x "
                                       "local_batch_size x seq_len"),
        "microbatch_s": Value(model["compute"] / g_init, f"{src}: compute / G"),
        "step_s": Value(stock, f"{src}: stock HSDP step (every system's failure-free step)"),
        "recover_overhead": Value(max(1.0, ours / stock),
                                  f"{src}: torch plane NCCL overlapped / stock = "
                                  f"{ours / stock:.4f}, clamped to >= 1"),
    }


def failure_inputs() -> dict[str, Value]:
    """In-job failure handling: detection, repair, restore, rejoin."""
    cost = _json("failure_cost.json")["recover_median"]
    det, join = _json("detection.json"), _json("rejoin.json")["debugmodel"]
    fc = "benchmarks/results/failure_cost.json: recover_median"
    return {
        "detect_death_s": Value(cost["detect_s"], f"{fc}.detect_s (a process death, ULFM)"),
        "repair_s": Value(cost["repair_s"], f"{fc}.repair_s"),
        "restore_s": Value(cost["restore_s"], f"{fc}.restore_s"),
        "detect_node_s": Value(det["netns_link_s3_slot"]["median_detect_s"],
                               "benchmarks/results/detection.json: netns_link_s3_slot (a node "
                               "of 3 ranks cut off, host-by-host numbering, cut -> repaired; "
                               "a node of 8 ranks takes longer: a lower bound)"),
        "join_after_s": Value(join["median_start_to_ready_s"] + JOIN_STARTUP_S,
                              "benchmarks/results/rejoin.json: debugmodel "
                              f"median_start_to_ready_s + constant {JOIN_STARTUP_S:.0f} s for a "
                              "GPU model's start-up (as projection.py)"),
        "join_stall_s": Value(join["median_join_stall_s"] + join["median_spawn_stall_s"],
                              "benchmarks/results/rejoin.json: debugmodel median_join_stall_s "
                              "+ median_spawn_stall_s"),
    }


def restart_inputs() -> dict[str, Value]:
    """A job restart: checkpoint save and load, the restart itself, the launcher's reaction."""
    rows = [r["checkpoint_restart"] for r in _json("failure_cost.json")["rows"]]
    relaunch = _json("relaunch.json")["table"]["kill_node/relaunch"]["fault_to_training_s_median"]
    fc = "benchmarks/results/failure_cost.json: rows[].checkpoint_restart, median"
    init, load = _median(r["restart_init_s"] for r in rows), _median(r["load_s"] for r in rows)
    return {
        "save_s": Value(_median(r["save_s_each"] for r in rows), f"{fc} save_s_each"),
        "load_s": Value(load, f"{fc} load_s"),
        "cr_detect_exit_s": Value(_median(r["detect_exit_s"] for r in rows),
                                  f"{fc} detect_exit_s"),
        "restart_s": Value(RESTART_S, f"constant: the paper's ~10 minutes per restart at scale "
                                      f"(projection.py's paper-scale default); measured here "
                                      f"{init:.1f} s for 4 CPU ranks ({fc} restart_init_s)"),
        "launcher_react_s": Value(max(0.0, relaunch - init - load),
                                  "benchmarks/results/relaunch.json: kill_node/relaunch "
                                  "fault_to_training_s_median less the measured restart_init + "
                                  "load (the launcher's own reaction)"),
        "cr_hang_s": Value(CR_HANG_S, "constant: TorchTitan 0.2.2's comm.train_timeout_seconds "
                                      "default (a hung collective ends the job after it)"),
        "torchft_stall_s": Value(_median(r["torchft"]["stall_s"]
                                         for r in _json("torchft.json")["rows"]),
                                 "benchmarks/results/torchft.json: rows[].torchft.stall_s, "
                                 "median (TorchFT 0.2.0, one replica group SIGKILLed)"),
        "fthsdp_stall_s": Value(FTHSDP_STALL_S, "constant: 3 minutes of stall per failure, "
                                "published for FT-HSDP at O(100K) GPUs (Salpekar et al., "
                                "'Training LLMs with Fault Tolerant HSDP on 100,000 GPUs', "
                                "arXiv 2602.00277, 2026: 10 min -> 3 min, effective training "
                                "time 44% -> 80%)"),
        "repair_s_host": Value(REPAIR_HOURS * 3600, "constant: a failed node is back in the "
                                                    f"standby pool {REPAIR_HOURS:.0f} h later"),
    }


def straggler_inputs() -> dict[str, Value]:
    """How slow a straggler is: the one the project measured (straggler_bench.py)."""
    bench = _json("straggler.json")
    seconds = {int(r): s for r, s in bench["slow"]["seconds_per_microbatch"].items()}
    slow = seconds.pop(int(bench["slow_replica"]))
    return {"straggler_slowdown": Value(
        slow / statistics.median(seconds.values()),
        "benchmarks/results/straggler.json: slow.seconds_per_microbatch of the slow replica / "
        "the others' median (a replica sleeping one microbatch's time per microbatch)")}


def settings() -> dict[str, Value]:
    """The project's settings the simulation follows (config defaults, and what it changes)."""
    return {
        "hang_s": config_default("timeouts", "hang_s", 300.0),
        "hang_floor_s": config_default("timeouts", "hang_floor_s", 30.0),
        "hang_progress_factor": config_default("timeouts", "hang_progress_factor", 40.0),
        "max_relaunches": config_default("tiers", "max_relaunches", 2),
        "keep_spares": config_default("workload", "keep_spares", True),
        "data_assignment": config_default("workload", "data_assignment", "exact"),
        "g_raise": config_default("workload", "g_raise", "ceil"),
        "recover_ratio": config_default("bad_replicas", "recover_ratio", 1.2),
        "slow_patience": config_default("bad_replicas", "slow_patience", 3),
        "respawn_after_steps": Value(1, "simulated with 1 (rejoin on; the config's default 0 "
                                        "leaves lost replicas out until a relaunch)"),
        "slow_ratio": Value(1.5, "simulated with 1.5 (straggler quotas on where cheap enough; "
                                 "the config's default 0 is off), as straggler_bench.py"),
    }


def load_all() -> dict[str, Value]:
    """Every input, by name."""
    return {**step_inputs(), **failure_inputs(), **restart_inputs(), **straggler_inputs(),
            **settings()}
