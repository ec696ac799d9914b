"""``recover-hsdp join --out DIR``: bring a lost replica of the job writing to DIR back.

The request is a file in ``DIR/join/requests/``; the job's writer counts the pending requests
in its next step's totals, and at the following step boundary the survivors spawn the
replacement (on ``--host`` when given, else on the job's hosts) and run the join protocol
([Note: rejoin at a boundary] in recover_hsdp/manager/rejoin.py). This command waits for the
outcome (the request moves to ``join/done/`` or ``join/failed/``) and reports it from
``events.jsonl``. Why a request and not ``MPI_Comm_connect`` from this process: see [Note:
rejoin] in recover_hsdp/collectives/join.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def request_join(out: Path, host: str | None) -> Path:
    folder = out / "join" / "requests"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.time():.6f}-{socket.gethostname()}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": host, "time": time.time()}))
    os.replace(tmp, path)  # the writer never sees half a request
    return path


def run_join(args) -> int:
    out = Path(args.out).resolve()
    if not (out / "procs.json").exists() or (out / "summary.json").exists():
        print(f"recover-hsdp: error: --out {out}: no running recover-hsdp job writes there "
              "(no procs.json, or its summary.json is written): start the job first",
              file=sys.stderr)
        return 2
    request = request_join(out, args.host)
    print(f"recover-hsdp join: requested ({request.name}); waiting for the next step boundary",
          flush=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        for outcome in ("done", "failed"):
            if (out / "join" / outcome / request.name).exists():
                return _report(out, outcome == "done")
        if (out / "summary.json").exists():
            break
        time.sleep(0.5)
    request.unlink(missing_ok=True)
    print("recover-hsdp: error: the job ended (or --timeout passed) before it took the request; "
          "nothing joined", file=sys.stderr)
    return 1


def _report(out: Path, ok: bool) -> int:
    joins = []
    for line in (out / "events.jsonl").read_text().splitlines() if (out / "events.jsonl").exists() else []:
        record = json.loads(line)
        if record.get("phase") == "join":
            joins.append(record)
    last = joins[-1] if joins else {}
    if ok:
        print(f"recover-hsdp join: replicas {last.get('joined_replicas')} joined before step "
              f"{last.get('step')} ({last.get('start_to_ready_s', float('nan')):.1f}s to start, "
              f"survivors stalled {last.get('join_stall_s', float('nan')):.2f}s); alive "
              f"{last.get('alive_replicas')}", flush=True)
        return 0
    relaunched = " (the job was relaunched meanwhile: see relaunch/)" if any(
        (out / "relaunch").glob("attempt-*")) else ""
    print("recover-hsdp: error: nothing joined (no replica was missing, or a process died during "
          f"the join: see {out / 'events.jsonl'}){relaunched}; the job goes on", file=sys.stderr)
    return 1
