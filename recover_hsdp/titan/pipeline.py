"""Pipeline stages inside a replica: what TorchTitan's schedule owns, what the step owns.

[Note: pipeline stages in a replica] A replica may be a pipeline of P stages, each D FSDP x T
TP ranks ([Note: replica layout] in config/checks.py): TorchTitan's own ``pipeline_llm`` splits
the model and builds a ``torch.distributed.pipelining`` schedule (1F1B, GPipe,
Interleaved1F1B: ``config.checks.PIPELINE_SCHEDULES``), exactly as stock TorchTitan does.

* The schedule owns one ReCoVer microbatch: ``schedule.step()`` cuts this FSDP rank's
  microbatch (``local_batch_size`` sequences) into ``local_batch_size /
  pipeline_parallel_microbatch_size`` pieces, runs them through the stages in its order, sends
  activations and their gradients between stages, and accumulates each stage's gradient.
* The step owns the sync ([Note: the step protocol] in manager/manager.py): the step decides how
  many microbatches a replica computes (G, a minor's q, extras after a shrink, a spare's zeroed
  one, none of an excluded culprit's) and when FSDP may reduce (``set_gradient_sync(last)``).
  Every schedule ends with ``PipelineStage.perform_reduce_grad`` on each of its stages (at the
  end of ``step()`` for single-stage schedules, as the REDUCE_GRAD action for runtime ones):
  FSDP's post-backward, i.e. the reduce-scatter, whose all-reduce hook is the cross-replica
  sum of recovery/buckets.py. :class:`HeldGradientSync` lets it run only while the step says
  sync: until the step's last microbatch the stage's backwards (which the schedule already runs
  with ``requires_gradient_sync`` off) accumulate unsharded gradients, and every bucket of every
  stage reaches the hook once per step, as without pipeline stages. Snapshots, epoch tags,
  restore + re-reduce, extras (computed after the sync, added to the snapshots) and audits are
  then unchanged, per stage.
* Why not a schedule built per quota (``n_microbatches`` = q x pieces, one ``step()`` a step):
  the quota differs per replica and per step, extras after a shrink are computed after the sync
  and need a backward of their own anyway, and a culprit's exclusion recomputes others'
  microbatches alone; one schedule step per ReCoVer microbatch serves all of these with the
  schedule TorchTitan built. The cost: the pipeline bubble once per microbatch instead of once
  per step (at G microbatches of k pieces, (P - 1) / (k + P - 1) of a microbatch's time, not
  (P - 1) / (G k + P - 1)); on a GPU, choose ``local_batch_size /
  pipeline_parallel_microbatch_size`` >= 2 P. And memory: the schedule's backward leaves a
  stage's parameters unsharded (``set_reshard_after_backward(False)``) until the held sync
  runs, so with FSDP degree > 1 they stay unsharded across the step's microbatches, beside the
  unsharded fp32 gradients FSDP accumulates without stages too.
* The loss: the schedule computes it on the last stage per piece with the TrainSpec's loss,
  :class:`MicrobatchLoss` (TorchTitan's cross-entropy, a token sum), which the step scales per
  microbatch by 1 / its nominal tokens (what the path without stages divides by) and the
  injected gradient factor ([Note: real failure injection]); stock TorchTitan leaves the scale
  at 1 and, under pipeline stages, backpropagates the token sum (TorchTitan 0.2.2 divides the
  logged loss only): its gradient is the ReCoVer one times the step's tokens, which Adam
  nearly ignores and clipping at ``max_norm`` erases while the norm is above it.
* Counting ([Note: measured microbatches] in recovery/buckets.py): each FSDP unit sees one
  backward per piece; :class:`recover_hsdp.recovery.BucketSync` counts pieces and divides by
  the pieces per microbatch (a remainder fails the epoch: a lost piece is a lost microbatch).
  Only the last stage has the loss: its TP rank 0 counts the loss and tokens of each FSDP rank.
* Liveness: a stage blocked in a send/recv to a lost peer waits like one in a collective; the
  replica heartbeat ends it ([Note: a replica leaves as a unit] in groups/replica_group.py),
  on any stage.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torchtitan.components.loss import build_cross_entropy_loss


class MicrobatchLoss:
    """The TrainSpec's loss: TorchTitan's (a token sum) times ``scale`` (1 unless the step
    sets it: [Note: pipeline stages in a replica]); with ``grad_factor`` on the value that is
    backpropagated only. ``values`` keeps what it returned (unscaled by ``grad_factor``) since
    :meth:`begin`, while ``recording``."""

    def __init__(self, base):
        self.base = base
        self.scale = 1.0
        self.grad_factor = 1.0
        self.recording = True
        self.values: list[torch.Tensor] = []

    def begin(self, scale: float, grad_factor: float) -> None:
        self.scale, self.grad_factor, self.values = scale, grad_factor, []

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.base(pred, labels)
        if self.scale != 1.0:
            loss = loss * self.scale
        if self.recording:
            self.values.append(loss.detach())
        return loss * self.grad_factor if self.grad_factor != 1.0 else loss

    def total(self) -> torch.Tensor | None:
        """The microbatch's loss: the sum over its pieces (None where no piece was computed
        here: a stage other than the last)."""
        return torch.stack([v.reshape(()) for v in self.values]).sum() if self.values else None


def build_microbatch_loss(job_config, **kwargs) -> MicrobatchLoss:
    """``TrainSpec.build_loss_fn`` of ``recover_llama3``."""
    return MicrobatchLoss(build_cross_entropy_loss(job_config, **kwargs))


def schedule_stages(schedule) -> list:
    """The ``PipelineStage`` objects this rank runs in ``schedule`` (one, or several for a
    looped schedule)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def pieces_per_microbatch(schedule) -> int:
    """Backward passes a stage's FSDP units see per schedule step."""
    return int(schedule._n_microbatches)


SET_UP = ("_prepare_forward_infra", "_prepare_backward_infra")
"""A stage's set-up on the schedule's first step: torch 2.13 runs a metadata forward and
backward of a real piece there (shapes, dtypes), which is no microbatch's."""


class HeldGradientSync:
    """Each stage's ``perform_reduce_grad`` runs only while ``enabled``: [Note: pipeline
    stages in a replica]. The overrides are per stage object (TorchTitan built the stages; the
    method is the schedule's one call into the stage's gradient sync); the stage's set-up
    (``SET_UP``) runs inside ``not_a_microbatch()`` (it stops the counting and the loss)."""

    def __init__(self, stages, not_a_microbatch=contextlib.nullcontext):
        self.enabled = True
        self.held = 0  # schedule steps whose sync was held (a test reads it)
        self._not_a_microbatch = not_a_microbatch
        for stage in stages:
            stage.perform_reduce_grad = functools.partial(self._reduce_grad,
                                                          stage.perform_reduce_grad)
            for name in SET_UP:
                if not hasattr(stage, name):
                    raise RuntimeError(f"torch's PipelineStage has no {name}: this torch's "
                                       "pipelining differs from the one recover-hsdp was built "
                                       "against (torch 2.13)")
                setattr(stage, name, functools.partial(self._set_up, getattr(stage, name)))

    def _set_up(self, original, *args, **kwargs):
        with self._not_a_microbatch():
            return original(*args, **kwargs)

    def _reduce_grad(self, original, grad_scale_factor: int) -> None:
        if self.enabled:
            original(grad_scale_factor)
        else:
            self.held += 1
