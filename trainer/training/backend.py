"""The training-backend interface the loop drives; trainer/backends implements it (local PyTorch + PEFT, Tinker).
It lives with the loop so that the loop never imports a concrete backend: the entry point builds one
(trainer.backends.build) and hands it in.

It mirrors Tinker's TrainingClient so that one trainer loop drives either: forward_backward accumulates
gradients for a batch, optim_step applies them, save_for_sampler publishes weights the sampler can load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from trainer.training.batch import TrainingExample
from trainer.training.loss_params import LossParams, Reduction
from trainer.training.losses import BatchScale


@dataclass(frozen=True)
class AdamParams:
    """Same fields as tinker.AdamParams, passed every step (schedules live in the loop). No defaults here: every
    value comes from the run's `optim:` section (trainer.training.schedule.build_adam_params / adam_params)."""

    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # 0 = no clipping


@dataclass
class ForwardBackwardResult:
    trainer_logprobs: list[list[float]]  # per example, aligned with target_ids; 0.0 at untrained positions
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


class TrainingBackend(Protocol):
    def forward_backward(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction = "sum",
        scale: BatchScale | None = None,
    ) -> ForwardBackwardResult:
        """Compute the loss on `examples` and accumulate its gradients (not applied until optim_step). The mean
        reductions divide by `scale` (the whole batch taken, untrained zero-variance sequences included), by the
        examples' own counts when it is None."""
        ...

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Apply accumulated gradients with AdamW; returns `optim/*` metrics."""
        ...

    def train_step(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction,
        adam: AdamParams,
        scale: BatchScale | None = None,
    ) -> tuple[ForwardBackwardResult, dict[str, float]]:
        """forward_backward then optim_step; a remote backend submits both before waiting for either."""
        ...

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: token ids at or above it are refused at intake."""
        ...

    def save_for_sampler(self, version: int) -> str:
        """Write the current adapter as policy `version`; returns a path/URI the sampler can load."""
        ...

    def save_state(self, name: str) -> str:
        """Checkpoint weights, optimizer, step counter and RNG; returns where."""
        ...

    def load_state(self, path: str) -> None:
        """Restore a checkpoint written by save_state so that the next step is the same as without the break."""
        ...

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by load_state)."""
        ...


@runtime_checkable
class TeacherScoring(Protocol):
    """A backend that scores a distillation teacher (trainer/training/distill.py): the local one."""

    def teacher_logprobs(self, examples: Sequence[TrainingExample]) -> list[list[float]]:
        """The teacher's logprob of every trained token of `examples` (0.0 elsewhere)."""
        ...
