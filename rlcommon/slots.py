"""How many LoRA adapters vLLM must hold at once (its --max-loras) for a policy window, and the window's default.

A rollout sampled from a version still in the window may be in flight, so every version in the window stays loaded:
the current one, `keep_versions` behind it, and the one being published, which is loaded before the oldest is
unloaded (vLLM refuses a load when all slots are taken).
"""

from __future__ import annotations

# The trainer's rollout.max_staleness default; the gateway keeps that many versions unless told otherwise (launch.sh
# always tells it: inference.keep_versions follows rollout.max_staleness unless set).
DEFAULT_MAX_STALENESS = 3
# What the gateway's inference.keep_versions counts (it was inference.max_staleness, a name it shared with the
# trainer's window, which it follows).
KEEP_VERSIONS_MEANING = "policy versions behind the current one that stay loaded"


def lora_slots(keep_versions: int) -> int:
    """vLLM's --max-loras for a gateway that keeps `keep_versions` versions behind the current one loaded."""
    return keep_versions + 2
