"""The losses' names, reductions and parameters (Tinker's defaults among them): what a config, a wire message or a
command line names. No torch here: the launcher reads the config that names them without importing it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossName = Literal[
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "grpo", "gspo", "stable_reinforce"
]
Reduction = Literal["sum", "token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]

RATIO_LOSSES: frozenset[str] = frozenset({"importance_sampling", "ppo", "cispo", "grpo"})
RatioMask = Literal["none", "sequence", "token"]
# Losses whose per-token terms weigh tokens by the trainer/sampler ratio: what a ratio mask can correct.
MASKABLE_LOSSES: frozenset[str] = RATIO_LOSSES | {"gspo", "stable_reinforce"}
DEFAULT_MASK_BOUNDS = (0.5, 2.0)  # ours: a token (or sequence) twice as likely, or half, under the trainer

# Tinker's defaults for `loss_fn_config` (clip thresholds are bounds on the ratio, not epsilons). Tinker's GSPO page
# writes the clip as PPO's, clip(s, 1 - eps_low, 1 + eps_high), without numbers: PPO's bounds are our reading.
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "ppo": (0.8, 1.2),
    "grpo": (0.8, 1.2),
    "gspo": (0.8, 1.2),
    "cispo": (0.0, 4.0),
}
CLIPPED_LOSSES: frozenset[str] = frozenset(DEFAULT_CLIP)
DEFAULT_DRO_BETA = 0.05
# The SDK's one published StableReinforce number is its loss_fn_config example, {"kl_coeff": 0.01}; the hosted
# default is not published, so the example is ours.
DEFAULT_KL_COEFF = 0.01


@dataclass(frozen=True)
class LossParams:
    name: LossName = "importance_sampling"
    clip_low_threshold: float | None = None  # None: Tinker's default for the loss
    clip_high_threshold: float | None = None
    beta: float = DEFAULT_DRO_BETA  # dro only
    tis_cap: float | None = None  # truncated-IS cap on the ratio, ratio losses only
    kl_coeff: float = DEFAULT_KL_COEFF  # stable_reinforce only: weight of the KL(sampler || trainer) penalty
    ratio_mask: RatioMask = "none"  # leave out tokens (or whole sequences) whose ratio is outside the bounds
    mask_low: float = DEFAULT_MASK_BOUNDS[0]
    mask_high: float = DEFAULT_MASK_BOUNDS[1]

    def clip_bounds(self) -> tuple[float, float]:
        low, high = DEFAULT_CLIP.get(self.name, (0.0, float("inf")))
        return (
            low if self.clip_low_threshold is None else self.clip_low_threshold,
            high if self.clip_high_threshold is None else self.clip_high_threshold,
        )
