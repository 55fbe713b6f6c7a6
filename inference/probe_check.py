"""Publish verification, the pure part: does the adapter vLLM loaded give the trainer's logprobs?

The trainer sends a few fixed prompts with its own top-k logprobs for the next token of each. The gateway asks vLLM
for one greedy token per prompt with its top-k logprobs on the new adapter: vLLM's *sampled-token* path, which
applies every LoRA target, lm_head included (vLLM issue 51594 reports prompt logprobs skipping an lm_head delta in
GPU kernels, so a check through prompt logprobs alone could pass a wrong adapter). One engine step answers all the
prompts. Token ids in both top-k lists are compared; ids at the edge of only one list (near-ties) are skipped, but
at least half of each list must be shared.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeCheck:
    max_abs_diff: float  # over the compared logprobs; inf when a prompt's top-k lists barely overlap
    compared: int  # logprobs compared
    tolerance: float
    worst_prompt: int | None = None  # the prompt with the largest difference (or too little overlap)

    @property
    def passed(self) -> bool:
        return self.compared > 0 and self.max_abs_diff <= self.tolerance

    def describe(self) -> str:
        where = "" if self.worst_prompt is None else f", worst at probe prompt {self.worst_prompt}"
        return (
            f"max |vLLM - trainer| logprob {self.max_abs_diff:.3g} over {self.compared} top-k logprobs, "
            f"tolerance {self.tolerance:.3g}{where}"
        )


def compare_probe(
    expected: list[dict[int, float]], served: list[dict[int, float]], tolerance: float
) -> ProbeCheck:
    """`expected[i]` and `served[i]`: token id -> logprob of the next token after probe prompt i."""
    worst, compared, worst_prompt = 0.0, 0, None
    for i, want in enumerate(expected):
        got = served[i] if i < len(served) else {}
        shared = want.keys() & got.keys()
        if 2 * len(shared) < len(want):
            return ProbeCheck(float("inf"), compared + len(shared), tolerance, i)
        diff = max(abs(want[t] - got[t]) for t in shared) if shared else 0.0
        compared += len(shared)
        if diff > worst or worst_prompt is None:
            worst, worst_prompt = max(worst, diff), i if diff >= worst else worst_prompt
    return ProbeCheck(worst if compared else float("inf"), compared, tolerance, worst_prompt)
