"""MPI worker for tests/collectives/test_collectives_faults.py: a training-like loop over the
collectives layer with a real failure injected (SIGKILL by a peer or by the victim itself, or
a hang caught by the watchdog).

Run under ULFM mpirun (see recover_hsdp.collectives.mpirun), R*S ranks:
    python collectives_worker.py --scenario NAME --S S --out DIR [--victims 1,2] [--second 3] ...

Each step: guarded all-reduce of a rank-specific integer-valued buffer on the shard communicator, a
guarded global all-reduce of a token count, a checksum allgather, then the consensus barrier; a step
that is not clean is redone (fresh buffers) under the new epoch, as the recovery layer would.
Every rank that ends (finished or retired) writes DIR/rank<w>.json; the test compares them.

Scenarios (the failure hits at step --fail-step):
  clean             no failure
  before_allreduce  victims SIGKILL themselves right before the shard all-reduce
  mid_allreduce     the lowest non-victim rank SIGKILLs the victims inside the all-reduce: a thread
                    watches the last element of the first chunk of its own buffer and kills as soon
                    as the in-place reduce has reached it; use a buffer of several chunks (--mb 16+)
  during_agree      victims SIGKILL themselves 0.3 s into the consensus Agree; a laggard rank enters
                    the Agree only once they are dead, so the Agree cannot finish before the kill and
                    the other ranks are blocked inside it
  during_shrink     victims die before the all-reduce; then --second ranks SIGKILL themselves 0.3 s
                    into the repair Shrink, while the laggard enters it only once they are dead
  during_rebuild    the same, but the --second ranks die inside the Splits that rebuild the
                    communicators (the repair must go round again)
  during_membership_agree   the same, inside the agreement on the new membership
  hang              victims sleep forever before the all-reduce; their own watchdog must kill them

--hook-thread: the shard all-reduce and the checksum all-gather run on a second thread while the
main thread waits for it, as CUDA autograd runs FSDP2's post-backward hook (and so the bucket's
reduce and the data plane's set-up) on its device thread ([Note: MPI from autograd's thread]).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

from recover_hsdp.collectives import MPI, Deadlines, FaultTolerantWorld  # MPI: rc set for ULFM
import numpy as np


REPAIR_PHASE = {"during_shrink": "shrink", "during_rebuild": "rebuild",
                "during_membership_agree": "agree-membership"}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True)
    p.add_argument("--S", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--victims", default="")
    p.add_argument("--second", default="", help="during_shrink: ranks that die inside the Shrink")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fail-step", type=int, default=1)
    p.add_argument("--mb", type=float, default=1.0, help="shard all-reduce size in MB (float32)")
    p.add_argument("--hook-thread", action="store_true",
                   help="the shard all-reduce and the all-gather on a second thread")
    p.add_argument("--hang-timeout", type=float, default=10.0,
                   help="Deadlines.hang_timeout_s (the hang scenario uses a short one)")
    return p.parse_args()


def ranks(s):
    return [int(x) for x in s.split(",") if x]


def kill_later(pid, delay):
    threading.Timer(delay, lambda: os.kill(pid, signal.SIGKILL)).start()


def wait_dead(pids, timeout=20.0):
    """Block until every pid is gone (or a zombie): the laggard of the during_* scenarios."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                        break
            except OSError:
                break
            time.sleep(0.01)


def kill_at_middle(buf, pids):
    """SIGKILL pids as soon as the in-place all-reduce of buf has written the last element of its
    first chunk ([Note: chunked reduces]): the other chunks are still to be reduced, so the
    victims die inside this all-reduce. (Watching the middle element instead left only one 4 MB
    chunk of a 16 MB buffer after the trigger; on a loaded 2-core box the victims sometimes
    finished it before the SIGKILL landed, and the death showed up one step late.)"""
    from recover_hsdp.collectives import CHUNK_BYTES

    mid = min(buf.size // 2, CHUNK_BYTES // buf.itemsize - 1)
    before = float(buf[mid])

    def watch():
        while float(buf[mid]) == before:
            time.sleep(0.0005)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def on_hook_thread(fn, arg, used):
    """``fn(arg)`` on a new thread while this one waits, as autograd's device thread runs a hook
    while the main thread waits in backward(); ``used`` collects the thread names."""
    box = {}

    def body():
        used.add(threading.current_thread().name)
        box["result"] = fn(arg)

    thread = threading.Thread(target=body, name="autograd-device-thread")
    thread.start()
    thread.join()
    return box["result"]


def contribution(pattern, rank, step):
    """Integer-valued float32 (exact): rank- and step-specific, and varying along the buffer (pattern =
    arange % 7) so chunk boundaries are checked."""
    return pattern + np.float32((rank + 1) * 100 + step)


def expected(pattern, members, step):
    return pattern * np.float32(len(members)) + np.float32(sum((r + 1) * 100 + step for r in members))


def main():
    a = parse()
    victims, second = ranks(a.victims), ranks(a.second)
    comm = MPI.COMM_WORLD
    me = comm.Get_rank()
    size = comm.Get_size()
    phase_count = {}
    state = {"step": -1}
    doomed = set(victims) | set(second)
    laggard = max(r for r in range(size) if r not in doomed)

    def on_phase(name):
        phase_count[name] = phase_count.get(name, 0) + 1
        if state["step"] != a.fail_step or phase_count[name] != 1 + (name == "consensus") * a.fail_step:
            return
        if a.scenario == "during_agree" and name == "consensus":
            if me in victims:
                kill_later(os.getpid(), 0.3)
            elif me == laggard:
                wait_dead([pids[v] for v in victims])
        if REPAIR_PHASE.get(a.scenario) == name:
            if me in second:
                kill_later(os.getpid(), 0.3)
            elif me == laggard:
                wait_dead([pids[v] for v in second])

    world = FaultTolerantWorld(comm, a.S, Deadlines.for_tests(a.hang_timeout), on_phase=on_phase)
    pids = world.allgather_global(os.getpid())
    assert pids is not None
    n = int(a.mb * (1 << 20)) // 4
    pattern = np.arange(n, dtype=np.float32) % 7
    world.heartbeat()  # [the caller's duty: beat between long computations]
    log = {"rank": me, "replica": world.replica, "shard": world.shard, "events": [], "sums": [],
           "value_errors": 0, "pid": os.getpid()}
    used: set[str] = set()

    def hook(fn, arg):  # where FSDP2's hook would call it
        return on_hook_thread(fn, arg, used) if a.hook_thread else fn(arg)

    def dump(status):
        log.update(status=status, epoch=world.epoch, alive_replicas=list(world.alive_replicas),
                   t_end=time.time(), hook_threads=sorted(used))
        with open(os.path.join(a.out, f"rank{me}.json.tmp"), "w") as f:
            json.dump(log, f)
        os.replace(os.path.join(a.out, f"rank{me}.json.tmp"), os.path.join(a.out, f"rank{me}.json"))

    for step in range(a.steps):
        state["step"] = step
        attempt = 0
        while True:
            buf = contribution(pattern, me, step)
            world.heartbeat()
            fail_now = step == a.fail_step and attempt == 0
            if fail_now and me in victims:
                if a.scenario == "before_allreduce" or a.scenario in REPAIR_PHASE:
                    os.kill(os.getpid(), signal.SIGKILL)
                if a.scenario == "hang":
                    with open(os.path.join(a.out, f"hang{me}.txt"), "w") as f:
                        f.write(str(time.time()))
                    while True:
                        time.sleep(3600)  # no heartbeat: the watchdog must SIGKILL this rank
            if fail_now and a.scenario == "mid_allreduce" and me == min(set(range(size)) - doomed):
                kill_at_middle(buf, [pids[v] for v in victims])
            ok = hook(world.allreduce, buf)
            if ok:
                members = world.shard_members()
                want = expected(pattern, members, step)
                if not np.array_equal(buf, want):
                    log["value_errors"] += 1
                    world.fail_epoch("wrong all-reduce result")  # revokes: releases the peers
                    ok = False
                log["sums"].append({"step": step, "epoch": world.epoch, "members": list(members),
                                    "first": float(buf[0]), "last": float(buf[-1])})
            tokens = np.array([me + 1], dtype=np.int64)
            ok_g = world.allreduce_global(tokens)
            if ok_g and int(tokens[0]) != sum(r + 1 for r in world.layout.alive_ranks()):
                log["value_errors"] += 1
                world.fail_epoch("wrong global all-reduce result")
                ok_g = False
            chk = hook(world.allgather, float(buf[0]))  # None at once when the epoch failed
            if chk is not None and len(set(chk)) != 1:
                log["value_errors"] += 1
            res = world.consensus(ok and ok_g)
            log["events"].append({
                "step": step, "attempt": attempt, "allreduce_ok": ok, "global_ok": ok_g,
                "clean": res.clean, "epoch": res.epoch, "dead": sorted(res.dead_replicas),
                "alive": list(res.alive_replicas), "retire": res.retire, "detect_s": res.detect_s,
                "repair_s": res.repair_s, "rounds": res.rounds, "t": time.time()})
            if res.retire:
                dump("retired")
                world.retire(f"scenario {a.scenario}")
            if res.clean:
                break
            attempt += 1
    ok = world.barrier()  # a guarded barrier between steps is fine; the job's last call is finish()
    dump("finished" if ok and world.finish() else "finished-not-clean")


if __name__ == "__main__":
    sys.exit(main())
