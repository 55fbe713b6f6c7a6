"""Per-token RL and supervised losses, with Tinker's names, math and default (sum) reduction.

Pure tensor functions: no model, no config objects, no logging. Tensors are [B, T] and already aligned so that
position t scores target token t (the shift by one happens in batch conversion).

Departures from Tinker, all opt-in and off by default:
- `grpo`: PPO-clip math (eps 0.2) meant for group-std-normalised advantages, as Atropos's example trainer does.
- `tis_cap`: truncated importance sampling. The ratio r = exp(trainer - sampler) is replaced by
  r~ = r * stopgrad(min(1, cap / r)), whose value is min(r, cap) and whose gradient is scaled by the same factor;
  it bounds the weight a token with a large train/inference mismatch can get.
- reductions other than `sum` divide by batch-level counts passed in by the caller (so gradient accumulation over
  micro-batches equals one big batch).
- every loss multiplies its per-token terms by `mask_BT`; Tinker relies on zero advantages at prompt positions
  instead, which is the same except for `dro`, whose quadratic term we also mask.
- `gspo` over a sequence whose `sequence_mask_BT` marks no token: Tinker's mean over an empty set is NaN; here the
  sequence ratio is 1 (log-ratio 0), so such a sequence trains as on-policy PPO would.
- `ratio_mask`: masking correction, as verl, SkyRL, TRL and NeMo-RL offer beside truncation. `token` leaves out of
  the loss each trained token whose ratio r = exp(trainer - sampler) lies outside [mask_low, mask_high] (ICEPOP's
  form); `sequence` leaves out every token of a sequence whose geometric-mean ratio (exp of the mean log-ratio over
  its trained tokens) lies outside the bounds. A masked token is trained as one with advantage 0 would be: it still
  counts in the mean reductions' denominators (BatchScale), its gradient is 0. The importance metrics describe
  every trained token, masked or not; `importance/masked_tokens` counts those masked.
- `stable_reinforce`: Tinker publishes its name, its `kl_coeff` and that it reads what the sampler recorded, not its
  objective. Ours is REINFORCE with the importance weight truncated at 1 (V-trace's rho-bar = 1) plus kl_coeff times
  the k3 estimate of KL(sampler || trainer): -sg(min(r, 1)) * A * lp + kl_coeff * (r - 1 - log r). On-policy (r = 1)
  its gradient is REINFORCE's; off-policy no token's weight exceeds 1, and the KL term pulls the trainer back toward
  the policy that sampled the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainer.training.loss_params import (
    CLIPPED_LOSSES,
    MASKABLE_LOSSES,
    RATIO_LOSSES,
    LossParams,
    Reduction,
)


@dataclass(frozen=True)
class LossInputs:
    trainer_logprobs_BT: torch.Tensor  # logprob of each target under the model being trained (carries grad)
    sampler_logprobs_BT: torch.Tensor  # logprob the sampler (vLLM/Tinker) reported for the same target
    advantages_BT: torch.Tensor  # ignored by cross_entropy
    mask_BT: (
        torch.Tensor
    )  # per-token weights (Tinker's `weights`), 0 = not trained; other inputs may be NaN there
    reduction_weights_BT: torch.Tensor  # from compute_reduction_weights over the *whole* batch
    # gspo: the tokens whose log-ratios the sequence ratio averages (Tinker's `sequence_ratio_mask`, nonzero = in);
    # None = the trained tokens (mask_BT). Trainer logprobs must be real there, not only where mask_BT is nonzero.
    sequence_mask_BT: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchScale:
    """What the mean reductions divide by: the sequences and trained tokens of the batch the step took, including
    the groups that carry no signal (all rewards equal), which are counted here and not trained. Without it, a step
    whose other groups were all solved would spread the whole update over the few sequences left; with it, a
    sequence's weight does not depend on how many of its neighbours had a reward spread (as in GRPO, where such
    sequences stay in the mean with advantage 0)."""

    sequences: int
    tokens: float

    @staticmethod
    def of(examples: Sequence[Any]) -> BatchScale:
        """The examples' own counts (each has a `loss_mask`): a batch in which every sequence trains."""
        return BatchScale(len(examples), float(sum(sum(e.loss_mask) for e in examples)))


def compute_reduction_weights(
    mask_BT: torch.Tensor, reduction: Reduction, total_tokens: float, total_sequences: int
) -> torch.Tensor:
    """Per-token multipliers that turn a sum of per-token losses into the requested reduction.

    `total_tokens` (sum of mask weights) and `total_sequences` describe the whole optimizer batch, not this
    micro-batch, so that per-micro-batch losses add up to the full-batch loss.
    """
    ones_BT = torch.ones_like(mask_BT, dtype=torch.float32)
    if reduction == "sum":
        return ones_BT
    if reduction == "token_mean":
        return ones_BT / max(total_tokens, 1e-8)
    if reduction == "seq_mean_token_sum":
        return ones_BT / max(total_sequences, 1)
    if reduction == "seq_mean_token_mean":
        tokens_B1 = mask_BT.float().sum(dim=1, keepdim=True).clamp_min(1e-8)
        return ones_BT / tokens_B1 / max(total_sequences, 1)
    raise ValueError(f"unknown reduction {reduction!r}")


def _where_mask(mask_BT: torch.Tensor, values_BT: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    # torch.where, not multiplication: 0 * NaN is NaN, and NaN gradients leak through products.
    return torch.where(mask_BT != 0, values_BT, torch.full_like(values_BT, fill))


def _ratio(inputs: LossInputs, tis_cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance ratio trainer/sampler (masked positions -> 1) and its truncated form."""
    log_ratio_BT = _where_mask(inputs.mask_BT, inputs.trainer_logprobs_BT - inputs.sampler_logprobs_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    if tis_cap is None:
        return ratio_BT, ratio_BT
    # In log space so that a ratio that overflows (exp(200)) still truncates to a finite cap.
    excess_BT = (log_ratio_BT - math.log(tis_cap)).clamp_min(0).detach()
    return ratio_BT, torch.exp(log_ratio_BT - excess_BT)


def _sequence_ratio(inputs: LossInputs) -> torch.Tensor:
    """GSPO-token (Tinker's form): every token's ratio has its sequence's value s = exp(mean over the sequence
    mask of log(trainer / sampler)), computed without gradient, and the gradient of its own logprob: d ratio_t =
    s * d trainer_t. An empty sequence mask gives s = 1."""
    in_seq_BT = (inputs.mask_BT if inputs.sequence_mask_BT is None else inputs.sequence_mask_BT) != 0
    trainer_BT = inputs.trainer_logprobs_BT
    diff_BT = (trainer_BT.detach() - inputs.sampler_logprobs_BT).float()
    # torch.where, not a product: positions outside the mask may hold NaN (padding, unsent logprobs).
    log_ratio_BT = torch.where(in_seq_BT, diff_BT, torch.zeros_like(diff_BT))
    seq_log_ratio_B1 = log_ratio_BT.sum(1, keepdim=True) / in_seq_BT.sum(1, keepdim=True).clamp_min(1)
    own_BT = _where_mask(inputs.mask_BT, trainer_BT).float()
    return torch.exp(seq_log_ratio_B1 + own_BT - own_BT.detach())


def ratio_kept(inputs: LossInputs, params: LossParams) -> torch.Tensor | None:
    """Which trained tokens the ratio mask keeps ([B, T] bool), or None without a mask. Computed without gradient
    from the detached log-ratio, in float64 so that a bound is applied the same way whatever the logprobs' dtype."""
    if params.ratio_mask == "none":
        return None
    trained_BT = inputs.mask_BT != 0
    diff_BT = (inputs.trainer_logprobs_BT.detach() - inputs.sampler_logprobs_BT).double()
    log_ratio_BT = torch.where(trained_BT, diff_BT, torch.zeros_like(diff_BT))
    low, high = math.log(params.mask_low), math.log(params.mask_high)
    if params.ratio_mask == "token":
        return trained_BT & (log_ratio_BT >= low) & (log_ratio_BT <= high)
    mean_B1 = log_ratio_BT.sum(1, keepdim=True) / trained_BT.sum(1, keepdim=True).clamp_min(1)
    return trained_BT & (mean_B1 >= low) & (mean_B1 <= high)


def _check_params(params: LossParams) -> None:
    if params.tis_cap is not None and params.name not in RATIO_LOSSES:
        raise ValueError(f"tis_cap applies to ratio losses {sorted(RATIO_LOSSES)}, not {params.name!r}")
    if not (math.isfinite(params.kl_coeff) and params.kl_coeff >= 0):
        raise ValueError(f"kl_coeff must be a finite number >= 0, got {params.kl_coeff!r}")
    if params.ratio_mask != "none":
        if params.name not in MASKABLE_LOSSES:
            raise ValueError(f"ratio_mask applies to {sorted(MASKABLE_LOSSES)}, not {params.name!r}")
        if not 0 < params.mask_low < 1 < params.mask_high < math.inf:
            raise ValueError(
                f"ratio_mask bounds must satisfy 0 < mask_low < 1 < mask_high, got [{params.mask_low}, "
                f"{params.mask_high}]"
            )


def _per_token_loss(inputs: LossInputs, params: LossParams, ratio_BT: torch.Tensor) -> torch.Tensor:
    mask_BT = inputs.mask_BT
    trainer_lp_BT = _where_mask(mask_BT, inputs.trainer_logprobs_BT)
    adv_BT = _where_mask(mask_BT, inputs.advantages_BT)
    low, high = params.clip_bounds()
    name = params.name
    if name == "cross_entropy":
        return -trainer_lp_BT
    if name == "importance_sampling":
        return -ratio_BT * adv_BT
    if name in ("ppo", "grpo", "gspo"):
        clipped_BT = torch.clamp(ratio_BT, low, high)
        return -torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    if name == "cispo":
        return -torch.clamp(ratio_BT, low, high).detach() * trainer_lp_BT * adv_BT
    if name == "dro":
        sampler_lp_BT = _where_mask(mask_BT, inputs.sampler_logprobs_BT)
        return -(trainer_lp_BT * adv_BT - 0.5 * params.beta * (trainer_lp_BT - sampler_lp_BT) ** 2)
    if name == "stable_reinforce":
        reinforce_BT = -ratio_BT.clamp_max(1.0).detach() * adv_BT * trainer_lp_BT
        if params.kl_coeff == 0:  # kept out entirely: 0 * an overflowed ratio would be NaN
            return reinforce_BT
        # log r taken before the exp, so that a ratio that underflows to 0 still gives a finite k3
        log_ratio_BT = _where_mask(mask_BT, inputs.trainer_logprobs_BT - inputs.sampler_logprobs_BT)
        return reinforce_BT + params.kl_coeff * (ratio_BT - 1 - log_ratio_BT)
    raise ValueError(f"unknown loss {name!r}")


def compute_loss(inputs: LossInputs, params: LossParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (scalar, differentiable) and metrics for one micro-batch.

    Metrics are sums/extremes over trained tokens so the caller can combine micro-batches:
    `importance/ratio_sum`, `importance/ratio_min`, `importance/ratio_max`, `importance/clipped_tokens`,
    `importance/mismatch_kl_sum`, `importance/abs_logprob_diff_sum`, `tokens/trained`, `loss/sum`.
    """
    _check_params(params)
    ratio_BT, _ = _ratio(inputs, params.tis_cap)  # over every trained token: what the metrics describe
    kept_BT = ratio_kept(inputs, params)
    trained = inputs
    if kept_BT is not None:
        # gspo's sequence ratio still averages the tokens it would without the mask.
        seq_mask_BT = inputs.mask_BT if inputs.sequence_mask_BT is None else inputs.sequence_mask_BT
        masked_BT = torch.where(kept_BT, inputs.mask_BT, torch.zeros_like(inputs.mask_BT))
        trained = replace(inputs, mask_BT=masked_BT, sequence_mask_BT=seq_mask_BT)
    _, used_ratio_BT = _ratio(trained, params.tis_cap)
    clip_ratio_BT = ratio_BT  # the ratio the clip bounds are compared with, for the clipped-token count
    if params.name == "gspo":
        used_ratio_BT = _sequence_ratio(trained)
        clip_ratio_BT = _sequence_ratio(inputs).detach()
    per_token_BT = _per_token_loss(trained, params, used_ratio_BT)
    # mask_BT doubles as Tinker's `weights` (cross_entropy); RL batches carry 0/1 masks.
    weighted_BT = per_token_BT * _where_mask(trained.mask_BT, trained.mask_BT.to(per_token_BT.dtype))
    loss = (
        weighted_BT * _where_mask(trained.mask_BT, trained.reduction_weights_BT.to(per_token_BT.dtype))
    ).sum()
    metrics = _compute_metrics(
        inputs, params, ratio_BT.detach(), weighted_BT.detach(), clip_ratio_BT.detach()
    )
    if kept_BT is not None:
        metrics["importance/masked_tokens"] = float(((inputs.mask_BT != 0) & ~kept_BT).sum().item())
    return loss, metrics


def _compute_metrics(
    inputs: LossInputs,
    params: LossParams,
    ratio_BT: torch.Tensor,
    per_token_BT: torch.Tensor,
    clip_ratio_BT: torch.Tensor,
) -> dict[str, float]:
    trained_BT = inputs.mask_BT != 0
    n_tokens = int(trained_BT.sum().item())
    ratio_T = ratio_BT[trained_BT].double()
    log_ratio_T = torch.log(ratio_T)
    low, high = params.clip_bounds()
    clipped = 0
    if params.name in CLIPPED_LOSSES and n_tokens:
        clip_T = clip_ratio_BT[trained_BT].double()
        clipped = int(((clip_T < low) | (clip_T > high)).sum().item())
    if params.tis_cap is not None and n_tokens:
        clipped += int((ratio_T > params.tis_cap).sum().item())
    if params.name == "stable_reinforce" and n_tokens:  # the tokens whose weight the truncation at 1 lowered
        clipped = int((ratio_T > 1).sum().item())
    # k3 estimator of KL(sampler || trainer): E_q[r - 1 - log r] >= 0, low variance (Schulman's note).
    mismatch_kl_sum = float((ratio_T - 1 - log_ratio_T).sum().item()) if n_tokens else 0.0
    return {
        "tokens/trained": float(n_tokens),
        "loss/sum": float(per_token_BT[trained_BT].double().sum().item()),
        "importance/ratio_sum": float(ratio_T.sum().item()) if n_tokens else 0.0,
        "importance/ratio_min": float(ratio_T.min().item()) if n_tokens else float("nan"),
        "importance/ratio_max": float(ratio_T.max().item()) if n_tokens else float("nan"),
        "importance/clipped_tokens": float(clipped),
        "importance/mismatch_kl_sum": mismatch_kl_sum,
        "importance/abs_logprob_diff_sum": float(log_ratio_T.abs().sum().item()) if n_tokens else 0.0,
    }


def soft_cross_entropy(logprobs_BTK: torch.Tensor, weights_BTK: torch.Tensor) -> torch.Tensor:
    """Tinker's cross_entropy with (N, K) targets (top-K distillation): -sum over t and k of w[t, k] * logprob of
    target k at position t, summed (Tinker's reduction). K = 1 with w = the loss mask is the plain cross_entropy.
    A zero weight keeps its cell out entirely, so padding cells may hold anything, NaN included."""
    if logprobs_BTK.shape != weights_BTK.shape:
        raise ValueError(
            f"soft_cross_entropy: logprobs {list(logprobs_BTK.shape)} and weights {list(weights_BTK.shape)} "
            "must have one shape"
        )
    kept_BTK = weights_BTK != 0
    lp_BTK = torch.where(kept_BTK, logprobs_BTK, torch.zeros_like(logprobs_BTK))
    return -(
        lp_BTK * torch.where(kept_BTK, weights_BTK, torch.zeros_like(weights_BTK)).to(lp_BTK.dtype)
    ).sum()


def finalize_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-micro-batch metrics from compute_loss into batch means/extremes."""
    total = sum(p["tokens/trained"] for p in parts)
    denom = max(total, 1.0)

    def _sum(key: str) -> float:
        return sum(p[key] for p in parts)

    mins = [p["importance/ratio_min"] for p in parts if p["tokens/trained"]]
    maxs = [p["importance/ratio_max"] for p in parts if p["tokens/trained"]]
    return {
        "tokens/trained": total,
        "importance/ratio_mean": _sum("importance/ratio_sum") / denom if total else float("nan"),
        "importance/ratio_min": min(mins) if mins else float("nan"),
        "importance/ratio_max": max(maxs) if maxs else float("nan"),
        "importance/clip_fraction": _sum("importance/clipped_tokens") / denom,
        "importance/masked_fraction": sum(p.get("importance/masked_tokens", 0.0) for p in parts) / denom,
        "importance/mismatch_kl": _sum("importance/mismatch_kl_sum") / denom,
        "importance/logprob_diff_mean": _sum("importance/abs_logprob_diff_sum") / denom,
    }
