"""Rebuild the results part of benchmarks/README.md from benchmarks/results/*.json.

    python benchmarks/report.py

Rewrites only the text between the ``<!-- results:begin -->`` and ``<!-- results:end -->``
markers (other sections, e.g. "Collectives", are kept), so every number in that part comes from
the last run of the scripts, never from a hand edit.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import checkpoint_restart_bench
import failure_cost_bench
import overhead_bench
import projection
import trajectory_bench
from _common import RESULTS, machine

README = Path(__file__).resolve().parent / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _stamp(name) -> str:
    """The file and when its runs were made: its mtime if it changed since the last commit,
    else the date of the commit that last wrote it (a checkout resets mtimes)."""
    import subprocess

    path = RESULTS / name
    when = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    git = ["git", "-C", str(RESULTS)]
    changed = subprocess.run([*git, "status", "--porcelain", "--", name], capture_output=True,
                             text=True).stdout.strip()
    committed = subprocess.run([*git, "log", "-1", "--format=%ct", "--", name],
                               capture_output=True, text=True).stdout.strip()
    if not changed and committed:
        when = datetime.fromtimestamp(int(committed), timezone.utc)
    return f"`benchmarks/results/{name}` ({when.strftime('%Y-%m-%d %H:%M UTC')})"


def build() -> str:
    m = machine()
    parts = [BEGIN, "",
             f"Machine of the runs below: {m['nproc']} CPUs ({m['cpu_model']}), "
             f"{m['mem_gib']} GiB memory, Python {m['python']}, no GPU; a shared machine "
             "(noisy: medians, ratios from side-by-side runs; MPI ranks busy-poll, so a loaded "
             "2-core host penalises the MPI path: run on an otherwise idle machine). "
             "Each JSON file records the git revision its runs used (`machine.revision`).", ""]
    data = _load("overhead.json")
    if data:
        args = data.get("args", {})
        parts += ["### Failure-free overhead (`overhead_bench.py`)", "",
                  f"From {_stamp('overhead.json')}: interleaved A/B pairs, "
                  f"{args.get('steps', '?')} steps per run, median over steps 3..N; medians of the "
                  "pairs. Plot: `benchmarks/results/overhead.png`.", "",
                  overhead_bench.markdown(data), ""]
    data = _load("checkpoint_restart.json")
    if data:
        a = data["args"]
        parts += ["### ReCoVer vs checkpoint-restart (`checkpoint_restart_bench.py`)", "",
                  f"From {_stamp('checkpoint_restart.json')}: {a['replicas']} replicas x 1 rank, "
                  f"{a['steps']} steps, global batch {a['global_batch']} (local batch "
                  f"{a['local_batch']}: B = {a['global_batch'] // a['local_batch']} microbatches "
                  f"per step), a replica lost after steps {data['fail_after']}, DCP every "
                  f"{a['interval']} steps for the baseline; {len(data['pairs'])} A/B pair(s), "
                  "medians. Tokens per second per alive rank in each window between failures. "
                  "Plot: `benchmarks/results/checkpoint_restart.png`.", "",
                  checkpoint_restart_bench._markdown(data), ""]
    data = _load("failure_cost.json")
    if data:
        parts += ["### Cost of one failure (`failure_cost_bench.py`)", "",
                  f"From {_stamp('failure_cost.json')}: 4 replicas, failure mid-interval "
                  "(after step N + N/2), one A/B pair per N. Plot: "
                  "`benchmarks/results/failure_cost.png`.", "",
                  failure_cost_bench.markdown(data), ""]
    data = _load("trajectory.json")
    if data:
        parts += ["### Loss trajectory with half the replicas lost (`trajectory_bench.py`)", "",
                  f"From {_stamp('trajectory.json')}: {data['args']['steps']} steps, faults "
                  f"`{'; '.join(data['faults'])}`. Plot: `benchmarks/results/trajectory.png`.",
                  "", trajectory_bench.markdown(data), ""]
    data = _load("projection.json")
    if data:
        parts += ["### Projection to 512 and 100k GPUs (`projection.py`)", "",
                  f"From {_stamp('projection.json')}, fed with `failure_cost.json` and "
                  "`overhead.json`. Plot: `benchmarks/results/projection.png`. Assumptions:", ""]
        parts += [f"- {a}" for a in data["assumptions"]]
        parts += ["", "Measured inputs: " + ", ".join(
            f"{k} = {v:.3g}" for k, v in data["measured"].items()),
            projection.markdown(data), ""]
    parts.append(END)
    return "\n".join(parts)


def main() -> None:
    text = README.read_text() if README.exists() else "# Benchmarks\n"
    section = build()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Results (issue 7 benchmarks)\n\n" + section + "\n"
    README.write_text(text)
    print(f"updated {README}")


if __name__ == "__main__":
    main()
