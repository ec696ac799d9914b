"""The pieces of [Note: pipeline stages in a replica] (titan/pipeline.py) on fakes: the held
sync and the set-up pass around stage objects, the microbatch loss."""

import contextlib

import pytest
import torch

from recover_hsdp.titan.pipeline import SET_UP, HeldGradientSync, MicrobatchLoss


class FakeStage:
    """The two methods of torch's PipelineStage the held sync wraps, recording calls."""

    def __init__(self):
        self.calls = []

    def perform_reduce_grad(self, grad_scale_factor):
        self.calls.append(("reduce", grad_scale_factor))

    def _prepare_forward_infra(self, n, args, kwargs=None, has_backward=False):
        self.calls.append(("forward set-up", n))
        return "forward meta"

    def _prepare_backward_infra(self, n, loss_fn=None, target=None):
        self.calls.append(("backward set-up", n))
        return "backward meta"


def test_held_sync_runs_the_stages_reduce_only_when_enabled():
    stages = [FakeStage(), FakeStage()]
    held = HeldGradientSync(stages)
    held.enabled = False
    for stage in stages:
        stage.perform_reduce_grad(1)
    assert [s.calls for s in stages] == [[], []] and held.held == 2
    held.enabled = True
    for stage in stages:
        stage.perform_reduce_grad(4)
    assert [s.calls for s in stages] == [[("reduce", 4)], [("reduce", 4)]]


def test_stage_set_up_runs_inside_not_a_microbatch():
    inside = []

    @contextlib.contextmanager
    def not_a_microbatch():
        inside.append(True)
        yield
        inside.append(False)

    stage = FakeStage()
    HeldGradientSync([stage], not_a_microbatch)
    assert stage._prepare_forward_infra(2, ("x",)) == "forward meta"
    assert stage._prepare_backward_infra(2, loss_fn=None) == "backward meta"
    assert inside == [True, False, True, False]
    assert stage.calls == [("forward set-up", 2), ("backward set-up", 2)]


def test_a_torch_without_the_set_up_methods_is_named():
    class Bare:
        def perform_reduce_grad(self, factor):
            pass

    with pytest.raises(RuntimeError, match=f"has no {SET_UP[0]}"):
        HeldGradientSync([Bare()])


def test_microbatch_loss_scales_records_and_separates_the_gradient_factor():
    loss = MicrobatchLoss(lambda pred, labels: (pred - labels).square().sum())
    pred, labels = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])
    assert loss(pred, labels).item() == 5.0 and loss.total().item() == 5.0  # stock: unscaled
    loss.begin(scale=0.5, grad_factor=3.0)
    assert loss.total() is None                      # a stage without the loss
    assert loss(pred, labels).item() == 7.5          # backpropagated: x 0.5 x 3
    assert loss(pred, labels).item() == 7.5
    assert loss.total().item() == 5.0                # reported: x 0.5, summed over pieces
    loss.recording = False
    loss(pred, labels)                               # a schedule's set-up pass
    assert loss.total().item() == 5.0
