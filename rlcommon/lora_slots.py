"""How many LoRA adapters vLLM must hold at once (its --max-loras) for a policy window, and the window's default.

A rollout sampled from a version still in the window may be in flight, so every version in the window stays loaded:
the current one, `keep_versions` behind it, and the one being published, which is loaded before the oldest is
unloaded; and the base model, which the gateway serves through a zero adapter of its own (base-zero-lora,
inference/samplers/base_lora.py). Every name that can be live needs a slot: vLLM 0.32 neither refuses a load when
all slots are taken nor frees a slot on unload (its unload drops only the name); a load past --max-loras evicts the
least recently used adapter, and an evicted adapter scheduled again is read from disk inside the engine loop, which
stalls every request meanwhile. --max-cpu-loras (vLLM's cache of loaded adapters) is given the same number.
"""

from __future__ import annotations

# The trainer's rollout.max_staleness default; the gateway keeps that many versions unless told otherwise (launch.sh
# always tells it: inference.keep_versions follows rollout.max_staleness unless set).
DEFAULT_MAX_STALENESS = 3
# What the gateway's inference.keep_versions counts (it was inference.max_staleness, a name it shared with the
# trainer's window, which it follows).
KEEP_VERSIONS_MEANING = "policy versions behind the current one that stay loaded"


def lora_slots(keep_versions: int) -> int:
    """vLLM's --max-loras for a gateway that keeps `keep_versions` versions behind the current one loaded: those,
    the current one, the one being published and the base model's zero adapter."""
    return keep_versions + 3
