"""Probe (issue 22 item 6): the join of join_connect_accept.py, retried, and the spawner's death.

3 parent ranks; rank 0 (the spawner) spawns PROBE_N children from COMM_SELF, merges with them
once (the link), and at each "boundary" opens a port, sends it over the link, the parents'
world Accepts (root = the spawner) and the children Connect + Merge. PROBE_MODE:
  retry    attempt 1: parent rank 2 dies right after the merge, the join channel's Iagree
           fails, everybody revokes it; parents shrink; the children go back to the link for a
           new port; attempt 2 completes (allreduce = 2 parents + N children).
  spawner  the spawner SIGKILLs itself while the children wait on the link (Ibcast polled):
           how long until each child notices (Test raises)?
  gone     parent rank 2 dies just before the parents' Accept (no repair first): what Accept does.
Run: mpirun <ULFM_MCA> -np 3 python join_retry_spawner.py
"""
import os, sys, time, signal
import mpi4py
mpi4py.rc.thread_level = "serialized"
mpi4py.rc.finalize = False
from mpi4py import MPI
import numpy as np
MODE = os.environ.get("PROBE_MODE", "retry")
N = int(os.environ.get("PROBE_N", "2"))
T0 = time.time()
child = len(sys.argv) > 1 and sys.argv[1] == "child"
def log(*a):
    print(f"[{'child' if child else 'parent'} {MPI.COMM_WORLD.Get_rank()} t={time.time()-T0:.2f}]", *a, flush=True)
def err(e): return MPI.Get_error_string(e.Get_error_class())
def agree(comm, flag):
    buf = np.array([1 if flag else 0], dtype=np.int32)
    for _ in range(5):
        try:
            comm.Iagree(buf).Wait(); return bool(buf[0] & 1)
        except MPI.Exception:
            buf[0] = 0; comm.Ack_failed()
    return False

if child:
    time.sleep(2.0)
    parent = MPI.Comm.Get_parent(); parent.Set_errhandler(MPI.ERRORS_RETURN)
    parent.Ibarrier().Wait(); log("ready")
    link = parent.Merge(high=True); link.Set_errhandler(MPI.ERRORS_RETURN)
    own = MPI.COMM_WORLD.Dup(); own.Set_errhandler(MPI.ERRORS_RETURN)
    for attempt in range(4):
        t = time.time()
        box = np.zeros(256, dtype=np.uint8)
        try:
            req = link.Ibcast(box, root=0)
            while not req.Test():
                time.sleep(0.05)
        except MPI.Exception as e:
            log(f"link lost after {time.time()-t:.2f}s waiting:", err(e)); os._exit(0)
        port = bytes(box).rstrip(b"\0").decode()
        if not port:
            log("told to exit"); os._exit(0)
        log("attempt", attempt, "port", port[:30])
        inter2 = own.Connect(port, root=0); inter2.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter2.Merge(high=True); merged.Set_errhandler(MPI.ERRORS_RETURN)
        ok = agree(merged, True)
        log("attempt", attempt, "agreed", ok, "size", merged.Get_size())
        if ok:
            buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
            log("joined: sum", buf[0]); time.sleep(1); os._exit(0)
        merged.Revoke()
    os._exit(1)

world = MPI.COMM_WORLD.Dup(); world.Set_errhandler(MPI.ERRORS_RETURN)
rank = world.Get_rank()
link = None
if rank == 0:
    inter = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "child"], maxprocs=N, root=0)
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    req = inter.Ibarrier()
    while not req.Test(): time.sleep(0.1)
    link = inter.Merge(high=False); link.Set_errhandler(MPI.ERRORS_RETURN)
    log("children ready, link", link.Get_size())
    if MODE == "spawner":
        time.sleep(1.0); log("spawner dies"); os.kill(os.getpid(), signal.SIGKILL)
if MODE == "spawner":
    time.sleep(30); os._exit(0)
world.Barrier()
for attempt in range(3):
    port = None
    if rank == 0:
        port = MPI.Open_port()
        box = np.zeros(256, dtype=np.uint8); box[:len(port)] = np.frombuffer(port.encode(), np.uint8)
        link.Ibcast(box, root=0).Wait()  # the children's Ibcast
    if MODE == "gone" and rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.time()
    try:
        inter2 = world.Accept(port, root=0); inter2.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter2.Merge(high=False); merged.Set_errhandler(MPI.ERRORS_RETURN)
    except MPI.Exception as e:
        log("accept/merge failed in", round(time.time()-t, 2), err(e)); merged = None
    if MODE == "retry" and attempt == 0 and rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    ok = merged is not None and agree(merged, True)
    log("attempt", attempt, "agreed", ok, "in", round(time.time()-t, 2))
    if ok:
        buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
        log("joined: sum", buf[0]); time.sleep(2); os._exit(0)
    if merged is not None:
        merged.Revoke()
    if rank == 0:
        MPI.Close_port(port)
    world.Revoke(); world = world.Shrink(); world.Set_errhandler(MPI.ERRORS_RETURN)
    log("world shrunk to", world.Get_size())
os._exit(1)
