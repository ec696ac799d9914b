import os, sys, time, signal
import mpi4py
mpi4py.rc.thread_level = "serialized"
mpi4py.rc.finalize = False
from mpi4py import MPI
import numpy as np
KILL = int(os.environ.get("PROBE_KILL", "1"))
T0 = float(os.environ.get("PROBE_T0", time.time()))
child = len(sys.argv) > 1 and sys.argv[1] == "child"
def log(*a):
    print(f"[{'child' if child else 'parent'} {MPI.COMM_WORLD.Get_rank()} t={time.time()-T0:.2f}]", *a, flush=True)
def err(e): return MPI.Get_error_string(e.Get_error_class())

if child:
    time.sleep(3.0)
    parent = MPI.Comm.Get_parent(); parent.Set_errhandler(MPI.ERRORS_RETURN)
    parent.Ibarrier().Wait(); log("barrier ok")
    m1 = parent.Merge(high=True); m1.Set_errhandler(MPI.ERRORS_RETURN)
    log("m1", m1.Get_size())
    own = MPI.COMM_WORLD.Dup(); own.Set_errhandler(MPI.ERRORS_RETURN)
    inter2 = own.Create_intercomm(0, m1, 0, 77); inter2.Set_errhandler(MPI.ERRORS_RETURN)
    merged = inter2.Merge(high=True); merged.Set_errhandler(MPI.ERRORS_RETURN)
    buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
    log("merged size", merged.Get_size(), "rank", merged.Get_rank(), "sum", buf[0])
    os._exit(0)

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
if rank == 0:
    while not req.Test(): time.sleep(0.1)
    log("ready")
    m1 = inter.Merge(high=False); m1.Set_errhandler(MPI.ERRORS_RETURN)
    peer = m1
else:
    peer = MPI.COMM_SELF
world.Barrier()
t = time.time()
inter2 = world.Create_intercomm(0, peer, 1, 77); inter2.Set_errhandler(MPI.ERRORS_RETURN)
merged = inter2.Merge(high=False); merged.Set_errhandler(MPI.ERRORS_RETURN)
buf = np.ones(1); merged.Allreduce(MPI.IN_PLACE, buf)
log("merged size", merged.Get_size(), "rank", merged.Get_rank(), "sum", buf[0], "in", round(time.time()-t, 3))
time.sleep(1.0)
os._exit(0)
