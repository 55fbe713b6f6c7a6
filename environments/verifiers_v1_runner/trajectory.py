"""From a verifiers v1 trace's message graph to the sequences run-api receives. Pure: no verifiers, no atroposlib, no
I/O, so the contract is tested without either installed.

verifiers v1 keeps the exact tokens itself: its training client renders each prompt to ids, the gateway's token-in
route samples from them, and the trace stores every message as a node holding its token span, a mask (True for the
ids the model sampled) and one sampler logprob per sampled id. A root-to-leaf path of nodes (a branch) is one
training sample: its ids concatenated are the last call's prompt + completion, which the gateway's ledger recorded.
The environment's messages and the chat template's scaffold are prompt positions (-100, logprob 1.0); each sampled id
is trained with its logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from environments.verifiers_runner.trajectory import (
    NOT_TRAINED,
    PROMPT_LOGPROB,
    Built,
    TrajectoryError,
    check_sampler_logprobs,
    check_token_ids,
)


@dataclass(frozen=True)
class NodeTokens:
    """One message node's tokens, as a v1 trace stores them (MessageNode: token_ids, mask, logprobs)."""

    token_ids: list[int]
    mask: list[bool]  # True where the model sampled the id
    logprobs: list[float]  # one per sampled id, in order


def build_branch(nodes: Sequence[NodeTokens], where: str) -> Built:
    """One branch's sequence. Refused (TrajectoryError naming the node): ids that are not token ids, a mask that
    does not line up with the ids, logprobs that do not line up with the sampled ids or are not finite and <= 0,
    and a branch with nothing sampled (nothing to train)."""
    tokens: list[int] = []
    masks: list[int] = []
    logprobs: list[float] = []
    turns = 0
    for i, node in enumerate(nodes):
        at = f"{where} node {i}"
        check_token_ids(node.token_ids, f"{at}: token_ids")
        if len(node.mask) != len(node.token_ids):
            raise TrajectoryError(f"{at}: {len(node.token_ids)} token ids but a mask of {len(node.mask)}")
        sampled = sum(bool(m) for m in node.mask)
        if len(node.logprobs) != sampled:
            raise TrajectoryError(
                f"{at}: {sampled} sampled ids but {len(node.logprobs)} logprobs; the sampler must answer one "
                "logprob per sampled id"
            )
        check_sampler_logprobs(node.logprobs, at)
        turns += sampled > 0
        sampled_lps = iter(node.logprobs)
        for token, is_sampled in zip(node.token_ids, node.mask, strict=True):
            tokens.append(token)
            masks.append(token if is_sampled else NOT_TRAINED)
            logprobs.append(float(next(sampled_lps)) if is_sampled else PROMPT_LOGPROB)
    if turns == 0:
        raise TrajectoryError(f"{where}: no sampled token (the rollout made no model call)")
    return Built(tokens, masks, logprobs, turns=turns, untrained_turns=0)
