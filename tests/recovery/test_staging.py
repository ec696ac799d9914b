"""[Note: no device tensor reaches MPI] (recover_hsdp/recovery/staging.py), on CPU.

A CUDA tensor refuses ``.numpy()``; ``RefusesNumpy`` does the same on the CPU, so the staged
path (host buffer, copy back after receiving) runs here: the rejoin state transfer of the
trainer (``join_tensors`` on the donor, the bytes moved as ``Rejoin`` moves them, ``join_tensors``
+ ``load_join_meta`` on the newcomer) and the staged bucket reduce must round-trip exactly.
Plain CPU tensors stay zero-copy views (no buffer allocated).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from recover_hsdp.recovery.staging import HostStaging, to_host, zero_copy_view


class RefusesNumpy(torch.Tensor):
    """A CPU tensor that, like a CUDA tensor, refuses ``.numpy()``."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to "
                        "copy the tensor to host memory first.")


def _refusing(*shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).as_subclass(RefusesNumpy).requires_grad_()


class _Optimizers:
    def __init__(self, params):
        self.optimizers = [torch.optim.AdamW(params, lr=1e-2, foreach=False)]

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self):
        for optimizer in self.optimizers:
            optimizer.zero_grad()


class _State:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _work(seed: int, steps: int):
    """The parts of a RecoverTrainer that its JoinWork methods touch, on RefusesNumpy tensors."""
    params = [_refusing(8, 5, seed=seed), _refusing(5, seed=seed + 100)]
    work = types.SimpleNamespace(
        model_parts=[types.SimpleNamespace(parameters=lambda: iter(params))],
        optimizers=_Optimizers(params), lr_schedulers=_State(seed), dataloader=_State(-seed),
        ntokens_seen=seed * 1000, _join_staging=HostStaging(), _join_staged=([], []))
    for _ in range(steps):
        loss = sum((p * p).sum() for p in params)
        loss.backward()
        work.optimizers.step()
        work.optimizers.zero_grad()
    from recover_hsdp.titan.trainer import RecoverTrainer

    for name in ("join_meta", "load_join_meta", "apply_join_meta", "join_tensors", "join_nbytes",
                 "_join_state", "_materialize_optimizer_state"):
        setattr(work, name, types.MethodType(getattr(RecoverTrainer, name), work))
    return work, params


def _state(work, params) -> list[torch.Tensor]:
    optimizer = work.optimizers.optimizers[0]
    out = [p.detach().as_subclass(torch.Tensor).clone() for p in params]
    for p in params:
        out += [v.as_subclass(torch.Tensor).clone() for _, v in sorted(optimizer.state[p].items())]
    return out


def test_refusing_tensors_refuse_numpy_like_cuda_and_meta():
    with pytest.raises(TypeError):
        _refusing(2, seed=0).detach().numpy()
    assert zero_copy_view(_refusing(2, seed=0)) is None
    assert zero_copy_view(torch.empty(3, device="meta")) is None
    assert zero_copy_view(torch.ones(3, dtype=torch.bfloat16)) is None


def test_rejoin_transfer_of_tensors_that_refuse_numpy_round_trips_exactly():
    """Today's ``join_tensors`` called ``.numpy()`` on every state tensor: on CUDA (here:
    RefusesNumpy) the donor and the newcomer raised and the join hung until its deadlines."""
    donor, donor_params = _work(seed=1, steps=3)
    newcomer, newcomer_params = _work(seed=2, steps=0)
    expected = _state(donor, donor_params)

    nbytes = donor.join_nbytes()  # from sizes alone, before anything is staged
    assert donor._join_staging.nbytes == 0
    buffers = donor.join_tensors()  # the donor's side of Rejoin._send_state
    assert sum(b.nbytes for b in buffers) == nbytes
    flat = np.concatenate([b.reshape(-1).view(np.uint8) for b in buffers])
    meta = donor.join_meta()
    received = newcomer.join_tensors()  # the newcomer's side of Rejoin._receive_state
    assert flat.size == sum(b.nbytes for b in received)
    lo = 0
    for buffer in received:
        view = buffer.reshape(-1).view(np.uint8)
        view[:] = flat[lo:lo + view.size]
        lo += view.size
    newcomer.load_join_meta(meta)

    got = _state(newcomer, newcomer_params)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert isinstance(newcomer_params[0], RefusesNumpy)
    assert newcomer.ntokens_seen == 1000 and newcomer.lr_schedulers.value == 1
    assert newcomer._join_staging.nbytes > 0  # staged, not shared


def test_plain_cpu_tensors_stay_zero_copy():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor(3.0)]
    staging = HostStaging()
    arrays = staging.to_numpy(tensors)
    arrays[0][0, 0] = 42.0
    assert tensors[0][0, 0] == 42.0 and staging.nbytes == 0
    staging.copy_back(tensors, arrays)
    assert tensors[0][0, 0] == 42.0


def test_staged_bf16_and_mixed_dtypes_round_trip():
    tensors = [torch.randn(7, dtype=torch.bfloat16), _refusing(3, seed=5).detach(),
               torch.arange(5, dtype=torch.int64).as_subclass(RefusesNumpy)]
    staging = HostStaging(pin=False)
    arrays = staging.to_numpy(tensors)
    copies = [a.copy() for a in arrays]
    targets = [torch.zeros_like(t) for t in tensors]
    staged = staging.to_numpy(targets, key="other")
    for dst, src in zip(staged, copies):
        dst.reshape(-1).view(np.uint8)[:] = src.reshape(-1).view(np.uint8)
    staging.copy_back(targets, staged)
    for t, target in zip(tensors, targets):
        assert torch.equal(t.as_subclass(torch.Tensor), target.as_subclass(torch.Tensor))


@pytest.mark.parametrize("chunk_bytes", [12, 4 << 20])
def test_staged_reduce_goes_chunk_by_chunk_and_copies_back(chunk_bytes):
    tensor = _refusing(37, seed=3).detach()
    expected = tensor.as_subclass(torch.Tensor) * 2
    seen = []

    def double(array: np.ndarray) -> bool:
        assert isinstance(array, np.ndarray) and array.dtype == np.float32
        seen.append(array.size)
        array *= 2
        return True

    staging = HostStaging(chunk_bytes=chunk_bytes, pin=False)
    assert staging.reduce(tensor, double)
    assert torch.equal(tensor.as_subclass(torch.Tensor), expected)
    assert max(seen) * 4 <= chunk_bytes and sum(seen) == 37
    assert staging.nbytes <= chunk_bytes
    assert not staging.reduce(tensor, lambda array: False)


def test_to_host_moves_tensors_in_nested_objects():
    obj = {"a": [torch.ones(2, device="meta")], "b": (1, "x"), "c": torch.zeros(1)}
    with pytest.raises(NotImplementedError):  # a meta tensor cannot be copied out: proves it tried
        to_host(obj)
    plain = {"a": [torch.ones(2)], "b": (1, "x")}
    assert to_host(plain)["a"][0] is plain["a"][0]


def test_release_hands_pinned_buffers_back_to_the_os(monkeypatch):
    """Issue 31 (rejoin without waste): a released pinned buffer leaves torch's pinned-host
    cache too (CPU: the cache call is recorded; pinned memory needs CUDA)."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append(1),
                        raising=False)
    pinned = HostStaging(pin=False)
    pinned.pin = True  # as on a CUDA host (CPU: the buffer itself is not page-locked)
    pinned._buffers["join"] = torch.empty(64, dtype=torch.uint8)
    pinned.release()
    assert pinned.nbytes == 0 and calls == [1]
    unpinned = HostStaging(pin=False)
    unpinned.buffer("join", 64)
    unpinned.release()
    assert unpinned.nbytes == 0 and calls == [1]   # nothing pinned: nothing to hand back
