import os, sys, time, signal
import mpi4py
mpi4py.rc.thread_level = "serialized"
mpi4py.rc.finalize = False
from mpi4py import MPI
import numpy as np
KILL = int(os.environ.get("PROBE_KILL", "1"))
T0 = time.time()
child = len(sys.argv) > 1 and sys.argv[1] == "child"
def log(*a):
    print(f"[{'child' if child else 'parent'} {MPI.COMM_WORLD.Get_rank()} t={time.time()-T0:.2f}]", *a, flush=True)
def err(e): return MPI.Get_error_string(e.Get_error_class())

if child:
    time.sleep(3.0)
    parent = MPI.Comm.Get_parent(); parent.Set_errhandler(MPI.ERRORS_RETURN)
    parent.Ibarrier().Wait(); log("barrier ok")
    port = parent.bcast(None, root=0) if False else None
    m1 = parent.Merge(high=True); m1.Set_errhandler(MPI.ERRORS_RETURN)
    port = m1.bcast(None, root=0)
    log("port", port)
    own = MPI.COMM_WORLD.Dup(); own.Set_errhandler(MPI.ERRORS_RETURN)
    inter2 = own.Connect(port, root=0); inter2.Set_errhandler(MPI.ERRORS_RETURN)
    merged = inter2.Merge(high=True); merged.Set_errhandler(MPI.ERRORS_RETURN)
    buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
    log("merged size", merged.Get_size(), "rank", merged.Get_rank(), "sum", buf[0])
    time.sleep(1); os._exit(0)

world = MPI.COMM_WORLD.Dup(); world.Set_errhandler(MPI.ERRORS_RETURN)
rank = world.Get_rank()
if rank == 0:
    inter = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "child"], maxprocs=int(os.environ.get("PROBE_N","1")), root=0)
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
    world.Revoke(); world = world.Shrink(); world.Set_errhandler(MPI.ERRORS_RETURN)
    log("world shrunk to", world.Get_size())
port = None
if rank == 0:
    while not req.Test(): time.sleep(0.1)
    log("ready")
    port = MPI.Open_port()
    m1 = inter.Merge(high=False); m1.Set_errhandler(MPI.ERRORS_RETURN)
    m1.bcast(port, root=0)
t = time.time()
inter2 = world.Accept(port, root=0); inter2.Set_errhandler(MPI.ERRORS_RETURN)
merged = inter2.Merge(high=False); merged.Set_errhandler(MPI.ERRORS_RETURN)
buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
log("merged size", merged.Get_size(), "rank", merged.Get_rank(), "sum", buf[0], "in", round(time.time()-t, 3))
time.sleep(2.0)
os._exit(0)
