from __future__ import annotations

import pytest

from trainer.training.config import OptimConfig
from trainer.training.schedule import build_adam_params, compute_lr


def test_warmup_then_constant():
    cfg = OptimConfig(lr=1.0, warmup_steps=4)
    assert [compute_lr(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_decay_reach_zero():
    lin = OptimConfig(lr=2.0, warmup_steps=2, schedule="linear", total_steps=6)
    assert [compute_lr(s, lin) for s in range(2, 8)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0, 0.0])
    cos = OptimConfig(lr=1.0, schedule="cosine", total_steps=4)
    assert [compute_lr(s, cos) for s in range(5)] == pytest.approx(
        [1.0, 0.853553, 0.5, 0.146447, 0.0], abs=1e-6
    )


def test_adam_params_carry_config():
    cfg = OptimConfig(lr=4e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5)
    p = build_adam_params(10, cfg)
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm) == (
        4e-5,
        0.9,
        0.95,
        1e-8,
        0.1,
        0.5,
    )
