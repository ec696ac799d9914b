"""benchmarks/memory_table.py runs and its rows follow from the 1B model's own sizes (8 x 8, G = 4)."""

import json
import subprocess
import sys

from conftest import REPO

GIB = 1 << 30


def test_memory_table_of_the_1b_config(tmp_path):
    out = tmp_path / "memory.json"
    result = subprocess.run([sys.executable, "benchmarks/memory_table.py", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| accumulation, unsharded, reduce dtype (G = 4) | 4.60 | device |" in result.stdout
    data = json.loads(out.read_text())
    params = data["sizes"]["params_total"]
    assert params == 1_235_814_400
    rows = {r["row"].split(" (")[0]: r["bytes"] for r in data["rows"]}
    # FSDP2 keeps unsharded fp32 gradients across no-sync microbatches: the whole model per rank
    assert rows["accumulation, unsharded, reduce dtype"] == params * 4
    # buckets: fp32 shards padded to a multiple of 8 rows, so a little over P * 4 / 8
    assert params * 4 / 8 <= rows["grads = buckets"] < params * 4 / 8 * 1.01
    assert rows["bucket snapshots"] == rows["grads = buckets"]
    assert rows["AdamW exp_avg + exp_avg_sq"] == 2 * params * 4 / 8
    assert len(data["sizes"]["units"]) == 17
