"""Learning-rate schedule and Adam parameters for an optimizer step. Pure: the step count is the only state,
and it lives in the backend (saved and restored with its checkpoints)."""

from __future__ import annotations

import math

from trainer.training.backend import AdamParams
from trainer.training.config import OptimConfig


def compute_lr(step: int, cfg: OptimConfig) -> float:
    """LR for the optimizer step numbered `step` (0-based): linear warmup to cfg.lr, then constant/linear/cosine
    decay that reaches 0 at cfg.total_steps (no decay when total_steps is 0)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_adam_params(step: int, cfg: OptimConfig) -> AdamParams:
    return AdamParams(
        learning_rate=compute_lr(step, cfg),
        beta1=cfg.beta1,
        beta2=cfg.beta2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        grad_clip_norm=cfg.grad_clip_norm,
    )


def adam_params(lr: float, **changes: float) -> AdamParams:
    """AdamParams at learning rate `lr` with every other value from OptimConfig's defaults (or `changes`), for
    callers outside the loop (benchmarks, tests)."""
    return build_adam_params(0, OptimConfig(lr=lr, **changes))  # type: ignore[arg-type]
