"""What vLLM's /v1/completions answers, as the gateway's samples: token ids, sampled logprobs, finish and stop
reasons, prompt logprobs."""

from __future__ import annotations

from typing import Any

from inference.wire import Sample


def parse_completion_choices(body: dict[str, Any]) -> list[Sample]:
    """Samples from a vLLM /v1/completions body requested with logprobs=0 and return_tokens_as_token_ids (and,
    when asked, prompt_logprobs)."""
    samples = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        lp = choice.get("logprobs") or {"tokens": [], "token_logprobs": []}
        ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        samples.append(
            Sample(
                token_ids=ids,
                logprobs=[float(x) for x in lp["token_logprobs"]],
                finish_reason=choice.get("finish_reason") or "stop",
                stop_reason=choice.get("stop_reason"),
                prompt_logprobs=parse_prompt_logprobs(choice.get("prompt_logprobs")),
            )
        )
    return samples


def parse_prompt_logprobs(raw: list[dict[str, Any] | None] | None) -> list[dict[int, float] | None] | None:
    """vLLM's per-position {"<id>": {"logprob", "rank", "decoded_token"}} as {id: logprob}, keeping vLLM's order
    (the prompt token first, then the top k). vLLM writes -9999.0 for a logprob of -inf."""
    if raw is None:
        return None
    return [
        None if pos is None else {int(t): float(entry["logprob"]) for t, entry in pos.items()} for pos in raw
    ]
