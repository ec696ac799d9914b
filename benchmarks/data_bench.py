"""Data path throughput: the debug model on the stream path (a local C4-format copy streamed
with ``datasets``, TorchTitan's tokenise-and-pack per stream slot) vs the local corpus (exact:
pre-packed windows), interleaved A/B runs of the same job (2 x 1, same model, seq_len and
batch; only the data differs).

    python benchmarks/data_bench.py [--pairs 3] [--steps 12]

Per run: median step time over steps 3..N and tokens/s = tokens per step / that. Prints the
per-pair ratio (stream / local corpus) and writes benchmarks/results/data_path.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import CONFIG, REPO, RESULTS, machine

sys.path.insert(0, str(REPO / "tests"))


def run(steps: int, data: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config",
                   str(CONFIG), "--replicas", "2", "--out", out, "--",
                   "--training.steps", str(steps), "--training.global_batch_size", "8", *data]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=900)
        rows = [json.loads(line) for line in
                (Path(out) / "metrics.jsonl").read_text().splitlines()][2:]
    step_s = statistics.median(row["step_time_s"] for row in rows)
    return {"step_s": step_s, "tokens_per_s": statistics.median(r["tokens"] for r in rows) / step_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    from c4_local import make_local_c4
    from recover_hsdp.titan.data import ensure_local_corpus

    ensure_local_corpus(REPO / "outputs" / "cache" / "local_corpus")
    with tempfile.TemporaryDirectory() as tmp:
        c4 = make_local_c4(Path(tmp) / "c4")
        stream = ("--training.dataset", "c4", "--training.dataset_path", str(c4),
                  "--recover.workload.data_assignment", "stream")
        pairs = []
        for pair in range(args.pairs):
            local, streamed = run(args.steps, ()), run(args.steps, stream)
            pairs.append({"local_corpus": local, "stream_c4": streamed,
                          "ratio": streamed["tokens_per_s"] / local["tokens_per_s"]})
            print(f"pair {pair}: local corpus {local['tokens_per_s']:.0f} tokens/s, stream "
                  f"{streamed['tokens_per_s']:.0f} tokens/s, ratio {pairs[-1]['ratio']:.3f}",
                  flush=True)
    result = {"machine": machine(), "layout": "2x1", "global_batch_size": 8, "steps": args.steps,
              "pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data_path.json").write_text(json.dumps(result, indent=1))
    print(f"median ratio stream / local corpus: {result['median_ratio']:.3f}")


if __name__ == "__main__":
    main()
