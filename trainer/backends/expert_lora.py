"""A published adapter of a mixture-of-experts model, written one expert at a time: the layout vLLM loads.

transformers 5 keeps a MoE layer's experts as 3-D parameters (`gate_up_proj` [experts, 2 x width, hidden], gate rows
first; `down_proj` [experts, hidden, width]), and PEFT adapts them through its ParamWrapper: A is [experts x r, in]
with each expert's rows together, B is [out, r x experts] with the expert index fastest, gate_up at rank 2r. The
model's checkpoints and vLLM 0.32 name the experts one by one (`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`;
Mixtral's `w1`, `w3`, `w2`), each a plain 2-D weight, and the gateway's adapter check reads the served base's
shapes from those names. So each expert's delta is written as 2-D LoRA under its own names. vLLM applies one rank and
one alpha to a whole adapter, so every module is written at the largest rank (zero rows and columns added to the
smaller ones), each module's scaling multiplied into its B, and lora_alpha set to that rank: any loader then computes
exactly the deltas the trainer has. Checkpoints (save_state) keep PEFT's own layout; only what vLLM loads changes.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

# model_type -> what the model's checkpoints (and vLLM) call an expert's gate, up and down projections
EXPERT_NAMES = {
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_next": ("gate_proj", "up_proj", "down_proj"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v2": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"


def expert_wrappers(peft_model: Any, adapter: str) -> list[tuple[str, Any]]:
    """(module name, module) of every PEFT wrapper of a 3-D expert parameter carrying `adapter`."""
    found = []
    for name, module in peft_model.named_modules():
        if getattr(module, "parameter_name", None) in ("gate_up_proj", "down_proj") and adapter in getattr(
            module, "lora_A", {}
        ):
            found.append((name, module))
    return found


def lora_scalings(peft_model: Any, adapter: str) -> dict[str, float]:
    """Each LoRA module's scaling (alpha / r, or its rank_pattern / alpha_pattern / rsLoRA value), by name."""
    return {
        name: float(module.scaling[adapter])
        for name, module in peft_model.named_modules()
        if adapter in getattr(module, "lora_A", {}) and adapter in getattr(module, "scaling", {})
    }


def split_experts(module: Any, adapter: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """One fused expert wrapper's LoRA as per-expert 2-D pairs (relative names `{e}.{proj}.lora_A.weight` ...),
    its scaling multiplied into B."""
    a = module.lora_A[adapter].weight.detach()
    b = module.lora_B[adapter].weight.detach() * float(module.scaling[adapter])
    rank = int(module.r[adapter])
    experts = a.shape[0] // rank
    a_e = a.reshape(experts, rank, a.shape[1])
    b_e = b.reshape(b.shape[0], rank, experts)
    gate, up, down = names
    out: dict[str, torch.Tensor] = {}
    for e in range(experts):
        b_one = b_e[:, :, e]
        if module.parameter_name == "gate_up_proj":
            width = b_one.shape[0] // 2
            parts = {gate: b_one[:width], up: b_one[width:]}
        else:
            parts = {down: b_one}
        for proj, b_part in parts.items():
            out[f"{e}.{proj}.{LORA_A}"] = a_e[e].clone()  # gate and up share A: one copy each (safetensors)
            out[f"{e}.{proj}.{LORA_B}"] = b_part.clone()
    return out


def padded(tensor: torch.Tensor, key: str, rank: int) -> torch.Tensor:
    """A (r x in) gains zero rows, B (out x r) zero columns, up to `rank`."""
    if key.endswith(LORA_A):
        missing = rank - tensor.shape[0]
        return torch.cat([tensor, tensor.new_zeros(missing, tensor.shape[1])]) if missing else tensor
    missing = rank - tensor.shape[1]
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], missing)], dim=1) if missing else tensor


def per_expert_layout(
    peft_model: Any, adapter: str, state: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], Any]:
    """(tensors, LoraConfig) to write for `adapter`: get_peft_model_state_dict's `state` and the adapter's own
    config when no expert weights are adapted; else the layout of this module's docstring."""
    config = peft_model.peft_config[adapter]
    wrappers = expert_wrappers(peft_model, adapter)
    if not wrappers:
        return state, config
    model_type = peft_model.get_base_model().config.model_type
    if model_type not in EXPERT_NAMES:
        raise ValueError(
            f"LoRA on the experts of a {model_type!r} model: its per-expert names for vLLM are known only for "
            f"{sorted(EXPERT_NAMES)}; adapt attention only (lora.target_modules: [q_proj, k_proj, v_proj, o_proj])"
        )
    fused = {name for name, _ in wrappers}
    scalings = lora_scalings(peft_model, adapter)
    flat: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module = key.removesuffix("." + LORA_A).removesuffix("." + LORA_B)
        if module in fused:
            continue
        if module not in scalings:
            raise ValueError(
                f"adapter tensor {key!r} belongs to no LoRA module of the model: cannot rescale it"
            )
        flat[key] = tensor.detach() * scalings[module] if key.endswith(LORA_B) else tensor.detach()
    for name, module in wrappers:
        owner = re.sub(r"(\.base_layer)+$", "", name)
        for rel, tensor in split_experts(module, adapter, EXPERT_NAMES[model_type]).items():
            flat[f"{owner}.{rel}"] = tensor
    rank = max(t.shape[0] for k, t in flat.items() if k.endswith(LORA_A))
    tensors = {k: padded(t, k, rank) for k, t in flat.items()}
    written = copy.deepcopy(config)
    written.r, written.lora_alpha, written.use_rslora = rank, rank, False
    written.rank_pattern, written.alpha_pattern, written.target_parameters = {}, {}, None
    written.target_modules = sorted(
        {k.removesuffix("." + LORA_A).rsplit(".", 1)[-1] for k in tensors if k.endswith(LORA_A)}
    )
    return tensors, written
