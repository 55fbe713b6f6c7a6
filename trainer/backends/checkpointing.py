"""Gradient checkpointing on some of a model's decoder layers: the memory plan chooses how many
(model.gradient_checkpointing auto, trainer/orchestration/memory_plan.py), this spreads them evenly and switches
them on. A recomputed layer keeps only its input for the backward and runs its forward again there."""

from __future__ import annotations

from typing import Any

from trainer.training.config import ModelConfig


def spread_layers(layers: int, count: int) -> list[int]:
    """`count` of `layers` layer indices, evenly spaced (every k-th when count divides layers)."""
    count = max(0, min(count, layers))
    return [j for j in range(layers) if (j + 1) * count // layers > j * count // layers]


def apply_gradient_checkpointing(model: Any, config: ModelConfig, on_cuda: bool) -> int:
    """Switch checkpointing on for the layers `config` asks for; returns how many recompute."""
    layers = model.get_decoder().layers
    count = config.recomputed_layers(len(layers), on_cuda)
    if count == 0:
        return 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    chosen = set(spread_layers(len(layers), count))
    for j, layer in enumerate(layers):
        layer.gradient_checkpointing = j in chosen
    return count
