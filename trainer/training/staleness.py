"""Which rollouts a step may train on: the policy version that sampled each sequence (the gateway's ledger, a
multi-turn sequence counted as its oldest turn's), and the split of a batch into what is within
rollout.max_staleness versions of the trainer and what is dropped as stale or of unknown version. Pure apart from
versions_by_group's one gateway call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.training.batch import earlier_turn_ends
from trainer.training.gateway_client import GatewayClient


@dataclass
class StalenessSplit:
    kept: list[Any]
    staleness: list[int]  # per kept group
    dropped_stale: int  # sequences
    dropped_unknown: int  # sequences sampled by an abandoned policy, or unknown ones with keep_unknown off
    kept_unknown: int = 0  # sequences the gateway never saw, trained under atroposlib's own lag bound
    # (index in groups, "stale" or "unknown_version") of each group dropped for its policy version
    dropped_groups: list[tuple[int, str]] = field(default_factory=list)
    kept_staleness: list[list[int]] = field(default_factory=list)  # per kept group, its known sequences' lags


ABANDONED = -1  # the gateway's lookup answer for a sequence sampled by a policy a rollback abandoned


def split_by_staleness(
    groups: list[Any],
    versions: list[list[int | None]],
    current: int,
    max_staleness: int,
    keep_unknown: bool = False,
) -> StalenessSplit:
    """Keep groups whose every sequence was sampled within `max_staleness` versions of `current`. A sequence the
    gateway never saw (an environment that re-tokenized a multi-turn chat, say) is kept with `keep_unknown`: the
    environment's max_batches_offpolicy still bounds its lag; one sampled by an abandoned policy never is."""
    out = StalenessSplit([], [], 0, 0)
    for index, (group, group_versions) in enumerate(zip(groups, versions)):
        n = len(group_versions)
        unknown = sum(v is None for v in group_versions)
        if ABANDONED in group_versions or (unknown and not keep_unknown):
            out.dropped_unknown += n
            out.dropped_groups.append((index, "unknown_version"))
            continue
        known = [v for v in group_versions if v is not None]
        lag = current - min(known, default=current)
        if lag > max_staleness:
            out.dropped_stale += n
            out.dropped_groups.append((index, "stale"))
            continue
        out.kept.append(group)
        out.kept_unknown += unknown
        out.staleness.extend(current - v for v in known)
        out.kept_staleness.append([current - v for v in known])
    return out


def versions_by_group(gateway: GatewayClient, groups: list[Any]) -> list[list[int | None]]:
    """The policy version that sampled each sequence, grouped like `groups` (one gateway lookup per batch). A
    multi-turn sequence gets its oldest turn's version: an episode can span a publish, and then its earlier turns were
    sampled by the version before. Each earlier turn is looked up as the prefix that ends with its reply; a prefix the
    ledger does not know (a re-tokenized turn) leaves the sequence's own version."""
    sequences = [list(seq) for g in groups for seq in g.get("tokens", [])]
    masks = [
        (g.get("masks") or [])[k] if k < len(g.get("masks") or []) else None
        for g in groups
        for k in range(len(g.get("tokens", [])))
    ]
    queries, turns = list(sequences), []
    for i, (seq, mask) in enumerate(zip(sequences, masks, strict=True)):
        if isinstance(mask, list) and len(mask) == len(seq):
            for end in earlier_turn_ends(mask):
                turns.append((i, len(queries)))
                queries.append(seq[:end])
    answers = gateway.lookup(queries)
    flat = answers[: len(sequences)]
    for i, q in turns:
        own, turn = flat[i], answers[q]
        if own is not None and turn is not None:
            flat[i] = min(own, turn)  # ABANDONED (-1) wins, as it should
    versions, i = [], 0
    for g in groups:
        n = len(g.get("tokens", []))
        versions.append(flat[i : i + n])
        i += n
    return versions
