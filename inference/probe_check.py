"""Publish verification, the pure part: does the adapter vLLM loaded give the trainer's logprobs?

The trainer sends a fixed prompt with its own greedy continuation and the logprob of each continuation token. The
gateway decodes the same prompt greedily on the new adapter and reads vLLM's *sampled-token* logprobs: that path
applies every LoRA target, lm_head included (vLLM issue 51594 reports prompt logprobs skipping an lm_head delta on
GPU kernels, so prompt logprobs alone could pass a wrong adapter). Positions are compared while both decodes agree;
at the first token where they part, both logprobs are still each side's maximum and are compared too (a near-tie
flips the argmax without a large difference; a different adapter moves the maximum), and the rest is skipped
(its contexts differ).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeCheck:
    max_abs_diff: float  # over the compared positions; inf when nothing could be compared
    compared: int
    diverged_at: int | None  # first position where vLLM's greedy token differs from the trainer's
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.compared > 0 and self.max_abs_diff <= self.tolerance

    def describe(self) -> str:
        where = "" if self.diverged_at is None else f"; greedy tokens part at position {self.diverged_at}"
        return (
            f"max |vLLM - trainer| logprob {self.max_abs_diff:.3g} over {self.compared} probe token(s), "
            f"tolerance {self.tolerance:.3g}{where}"
        )


def compare_probe(
    expected_ids: list[int],
    expected_logprobs: list[float],
    served_ids: list[int],
    served_logprobs: list[float],
    tolerance: float,
) -> ProbeCheck:
    worst, compared, diverged = 0.0, 0, None
    for i, (want, got) in enumerate(zip(expected_ids, served_ids)):
        if i >= len(served_logprobs):
            break
        worst = max(worst, abs(served_logprobs[i] - expected_logprobs[i]))
        compared += 1
        if want != got:
            diverged = i
            break
    return ProbeCheck(worst if compared else float("inf"), compared, diverged, tolerance)
