import os, sys, time, signal
import mpi4py
mpi4py.rc.thread_level = "serialized"
mpi4py.rc.finalize = False
from mpi4py import MPI
import numpy as np

KILL = int(os.environ.get("PROBE_KILL", "1"))
def log(*a):
    print(f"[{'child' if child else 'parent'} {MPI.COMM_WORLD.Get_rank()} t={time.time()-T0:.2f}]", *a, flush=True)
T0 = float(os.environ.get("PROBE_T0", time.time()))
child = len(sys.argv) > 1 and sys.argv[1] == "child"

def err(e):
    return MPI.Get_error_string(e.Get_error_class())

if child:
    time.sleep(3.0)  # start-up
    parent = MPI.Comm.Get_parent(); parent.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        parent.Ibarrier().Wait(); log("barrier ok")
    except MPI.Exception as e:
        log("barrier failed:", err(e))
        try: parent.Ack_failed()
        except Exception as e2: log("ack failed", e2)
    t = time.time()
    inter2 = parent.Shrink(); inter2.Set_errhandler(MPI.ERRORS_RETURN)
    log("shrink ok", time.time()-t, "remote size", inter2.Get_remote_size())
    merged = inter2.Merge(high=True); merged.Set_errhandler(MPI.ERRORS_RETURN)
    buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
    log("merged size", merged.Get_size(), "sum", buf[0])
    os._exit(0)

world = MPI.COMM_WORLD.Dup(); world.Set_errhandler(MPI.ERRORS_RETURN)
rank = world.Get_rank()
inter = world.Spawn(sys.executable, [__file__, "child"], maxprocs=1, root=0)
inter.Set_errhandler(MPI.ERRORS_RETURN)
req = inter.Ibarrier()
log("spawned")
if KILL and rank == 2:
    time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1.0)
buf = np.ones(1)
try:
    world.Allreduce(MPI.IN_PLACE, buf); log("allreduce ok")
except MPI.Exception as e:
    log("allreduce failed", err(e))
    world.Revoke()
    world = world.Shrink(); world.Set_errhandler(MPI.ERRORS_RETURN)
    log("world shrunk to", world.Get_size())
ready = False
for i in range(100):
    try:
        if req.Test():
            ready = True; log("barrier test: ready"); break
    except MPI.Exception as e:
        log("barrier test failed:", err(e)); break
    time.sleep(0.1)
log("ready", ready, "- failed group size", inter.Get_failed().Get_size() if hasattr(inter, "Get_failed") else "?")
time.sleep(4.0)  # the child is surely in its barrier/shrink by now
t = time.time()
inter2 = inter.Shrink(); inter2.Set_errhandler(MPI.ERRORS_RETURN)
log("shrink ok", time.time()-t, "local", inter2.Get_size(), "remote", inter2.Get_remote_size())
merged = inter2.Merge(high=False); merged.Set_errhandler(MPI.ERRORS_RETURN)
buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
log("merged size", merged.Get_size(), "sum", buf[0])
time.sleep(1.0)
os._exit(0)
