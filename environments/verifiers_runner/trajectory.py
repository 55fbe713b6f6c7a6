"""From a verifiers rollout's turns (what the gateway's chat completions answered: prompt_token_ids, the choice's
token_ids and its logprobs) to the sequence run-api receives. Pure: no verifiers, no atroposlib, no I/O, so the
trainer's side of the contract is tested without either installed.

One rollout becomes one sequence. Its turns merge into one when each turn's prompt ids begin with everything before
it (the previous prompt and the tokens the model sampled): the environment's tokens between two turns (tool output,
user turns, the chat template's own delimiters) are then prompt positions, never trained, and every sampled token is
trained with its sampler logprob. The merged sequence is exactly the last turn's prompt + completion, which is what
the gateway's ledger recorded, so the trainer finds its policy version. When a later prompt does not begin with the
earlier tokens (the chat template re-rendered the model's text into other ids), only the last turn is trained: its
prompt, earlier replies included, is masked, since those ids are a re-tokenization the sampler never produced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NOT_TRAINED = -100  # run-api's mask for a position the trainer does not train
PROMPT_LOGPROB = 1.0  # run-api's placeholder logprob at prompt positions


class TrajectoryError(ValueError):
    """A rollout whose tokens cannot be trained as sampled; the message names the turn and the field."""


@dataclass(frozen=True)
class Turn:
    """One model call of a rollout, as the gateway answered it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]


@dataclass(frozen=True)
class Built:
    """One rollout's sequence: tokens, masks (-100 or the token id) and logprobs aligned with tokens."""

    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    turns: int  # model calls in the rollout
    untrained_turns: int  # earlier turns left out because a later prompt did not begin with them


def check_turn(turn: Turn, where: str) -> None:
    """Refuse what cannot be trained exactly: ids that are not ints, logprobs that do not line up with the sampled
    ids, or are not finite (a sampler logprob is finite and at most 0)."""
    if not turn.prompt_ids:
        raise TrajectoryError(f"{where}: empty prompt_token_ids")
    for name, ids in (("prompt_token_ids", turn.prompt_ids), ("token_ids", turn.completion_ids)):
        check_token_ids(ids, f"{where}: {name}")
    if len(turn.completion_logprobs) != len(turn.completion_ids):
        raise TrajectoryError(
            f"{where}: {len(turn.completion_ids)} sampled token ids but {len(turn.completion_logprobs)} logprobs; "
            "the sampler must return one logprob per sampled token (logprobs=true)"
        )
    check_sampler_logprobs(turn.completion_logprobs, where)


def check_token_ids(ids: Sequence[Any], what: str) -> None:
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
    if bad is not None:
        raise TrajectoryError(f"{what} holds {bad!r}, not a token id")


def check_sampler_logprobs(logprobs: Sequence[Any], where: str) -> None:
    """A sampler logprob is a finite number, at most 0."""
    bad = next(
        (lp for lp in logprobs if not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 0), None
    )
    if bad is not None:
        raise TrajectoryError(f"{where}: sampler logprob {bad!r} is not a finite number <= 0")


def build_sequence(turns: Sequence[Turn]) -> Built:
    """The rollout's trained sequence (module docstring): all turns merged when each prompt extends what came before,
    else the last turn alone."""
    if not turns:
        raise TrajectoryError("the rollout made no model call")
    for i, turn in enumerate(turns):
        check_turn(turn, f"turn {i}")
    first = turns[0]
    tokens = [*first.prompt_ids, *first.completion_ids]
    masks = [NOT_TRAINED] * len(first.prompt_ids) + list(first.completion_ids)
    logprobs = [PROMPT_LOGPROB] * len(first.prompt_ids) + list(first.completion_logprobs)
    for turn in turns[1:]:
        if turn.prompt_ids[: len(tokens)] != tokens:
            return Built(*last_turn_only(turns[-1]), turns=len(turns), untrained_turns=len(turns) - 1)
        between = turn.prompt_ids[len(tokens) :]
        tokens += [*between, *turn.completion_ids]
        masks += [NOT_TRAINED] * len(between) + list(turn.completion_ids)
        logprobs += [PROMPT_LOGPROB] * len(between) + list(turn.completion_logprobs)
    return Built(tokens, masks, logprobs, turns=len(turns), untrained_turns=0)


def last_turn_only(turn: Turn) -> tuple[list[int], list[int], list[float]]:
    n = len(turn.prompt_ids)
    return (
        [*turn.prompt_ids, *turn.completion_ids],
        [NOT_TRAINED] * n + list(turn.completion_ids),
        [PROMPT_LOGPROB] * n + list(turn.completion_logprobs),
    )


def scored_group(built: Sequence[Built], scores: Sequence[float]) -> dict[str, Any]:
    """The group run-api receives, in the form ManagedServer-based environments send (environments.common's
    group_from_nodes): tokens, masks, scores and inference_logprobs, one entry per rollout."""
    if len(built) != len(scores):
        raise TrajectoryError(f"{len(built)} sequences but {len(scores)} scores")
    bad = next((s for s in scores if not isinstance(s, int | float) or not math.isfinite(s)), None)
    if bad is not None:
        raise TrajectoryError(f"the rubric scored a rollout {bad!r}; a reward must be a finite number")
    return {
        "tokens": [b.tokens for b in built],
        "masks": [b.masks for b in built],
        "scores": [float(s) for s in scores],
        "inference_logprobs": [b.logprobs for b in built],
    }


def turn_from_tokens(tokens: Any, where: str) -> Turn:
    """A verifiers trajectory step's `tokens` (prompt_ids, completion_ids, completion_logprobs), which verifiers
    fills only when the answer carried prompt_token_ids, the choice's token_ids and logprobs."""
    if tokens is None:
        raise TrajectoryError(
            f"{where}: the chat completion came back without prompt_token_ids, token_ids or logprobs; the gateway "
            "must answer chat completions with return_token_ids and logprobs=true"
        )
    try:
        return Turn(
            prompt_ids=list(tokens["prompt_ids"]),
            completion_ids=list(tokens["completion_ids"]),
            completion_logprobs=[float(x) for x in tokens["completion_logprobs"]],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TrajectoryError(f"{where}: unreadable token record ({type(exc).__name__}: {exc})") from exc
