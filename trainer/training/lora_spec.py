"""One LoRA definition for both backends. The run config's `lora.*` names modules (PEFT's way); Tinker's LoRA takes a
rank and three switches, `train_attn`, `train_mlp`, `train_unembed` (the tinker SDK's create_lora_training_client,
each True by default). tinker_lora_flags maps the first onto the second and refuses, with the reason, what the
switches cannot express, so that a `--backend tinker` run trains the adapter a local run of the same recipe trains
(never a silently different one). The local backend and the Tinker-protocol service read the module groups here."""

from __future__ import annotations

from typing import Any

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
# The tinker SDK takes no alpha. tinker-cookbook's learning-rate helper (hyperparam_utils.
# get_lora_lr_over_full_finetune_lr) takes lora_alpha=32 as its default, the one value we can point to: a run on
# Tinker must state it, so that its local twin scales the adapter the same way.
TINKER_ALPHA = 32


class LoraMismatch(ValueError):
    """lora.* asks for something Tinker's LoRA cannot express."""


def module_targets(target_modules: list[str] | str) -> list[str]:
    """The modules `lora.target_modules` adapts on a Llama/Qwen-style decoder ('all-linear': attention and MLP,
    lm_head left out, as PEFT does)."""
    if target_modules == "all-linear":
        return [*ATTN, *MLP]
    return list(target_modules)


def tinker_lora_flags(lora: Any) -> dict[str, bool]:
    """train_attn, train_mlp and train_unembed for Tinker from a LoraConfig; LoraMismatch for what they cannot
    express: part of attention or of the MLP, other modules, an alpha other than TINKER_ALPHA, dropout."""
    targets = module_targets(lora.target_modules)
    known = {*ATTN, *MLP, *UNEMBED}
    other = [t for t in targets if t not in known]
    if other:
        raise LoraMismatch(
            f"lora.target_modules names {other}: Tinker's LoRA trains only attention, the MLP and the unembedding; "
            f"use those module names ({', '.join(sorted(known))}) or launch.backend=local"
        )
    flags = {}
    for switch, group in (("train_attn", ATTN), ("train_mlp", MLP)):
        chosen = [m for m in group if m in targets]
        if chosen and len(chosen) != len(group):
            raise LoraMismatch(
                f"lora.target_modules has {chosen} but not {[m for m in group if m not in chosen]}: Tinker trains "
                f"{', '.join(group)} together ({switch}); name all of them or none"
            )
        flags[switch] = bool(chosen)
    flags["train_unembed"] = "lm_head" in targets
    if not any(flags.values()):
        raise LoraMismatch("lora.target_modules selects nothing Tinker's LoRA can train")
    if lora.alpha != TINKER_ALPHA:
        raise LoraMismatch(
            f"lora.alpha={lora.alpha}: the tinker SDK sets no alpha (tinker-cookbook assumes {TINKER_ALPHA}); set "
            f"lora.alpha={TINKER_ALPHA} so that a local run of this recipe scales its adapter as Tinker does"
        )
    if lora.dropout:
        raise LoraMismatch(f"lora.dropout={lora.dropout}: Tinker's LoRA has no dropout; set lora.dropout=0")
    return flags
