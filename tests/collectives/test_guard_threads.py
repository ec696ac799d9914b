"""[Note: MPI from autograd's thread] in process: a guarded call works on a second thread (as
CUDA autograd runs FSDP2's hook on its device thread), and a call that a second thread starts
while another thread is inside one is refused instead of breaking THREAD_SERIALIZED. The real
MPI path on a second thread, with a peer SIGKILLed mid-reduce, is test_collectives_faults.py's
``*-on-autograd-thread`` scenarios."""

import threading

import pytest

from recover_hsdp.collectives.guard import ConcurrentMpiCall, Deadlines, MpiGuard


@pytest.fixture
def guard():
    g = MpiGuard(Deadlines(call_s=400, repair_s=500, hang_timeout_s=300, poll_s=1000.0))
    yield g
    g.close()


def _on_thread(fn) -> dict:
    box: dict = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    thread = threading.Thread(target=body, name="autograd-device-thread")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    return box


def test_a_guarded_call_on_a_second_thread_runs_and_clears(guard):
    def hook():
        with guard.call("Allreduce(shard)", 30):
            return guard._call[0], guard._owner == threading.get_ident()

    box = _on_thread(hook)
    assert box == {"result": ("Allreduce(shard)", True)}
    assert guard._call is None and guard._owner is None
    with guard.call("Agree", 30):  # the main thread's turn afterwards
        pass


def test_a_call_while_another_thread_is_inside_one_is_refused(guard):
    inside, leave = threading.Event(), threading.Event()

    def hook():
        with guard.call("Allreduce(shard)", 30):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=hook, name="autograd-device-thread")
    thread.start()
    assert inside.wait(10)
    try:
        with pytest.raises(ConcurrentMpiCall, match=r"Iprobe\(global\).*Allreduce\(shard\)"):
            with guard.call("Iprobe(global)", 30):
                pass
        assert guard._call[0] == "Allreduce(shard)"  # the refused call left the other one alone
    finally:
        leave.set()
        thread.join(10)
    with guard.call("Iprobe(global)", 30):  # serialized again: allowed
        pass


def test_nested_calls_on_one_thread_are_still_a_bug(guard):
    with guard.call("Allreduce(shard)", 30):
        with pytest.raises(AssertionError, match="nested guarded MPI calls"):
            with guard.call("Agree", 30):
                pass
    assert guard._call is None
