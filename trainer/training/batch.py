"""Atropos batch intake: validate scored-data groups from run-api's `GET /batch` and turn them into per-token
training examples (shifted by one for the causal loss).

Pure: no model, no I/O. A bad group or sequence never raises; it is dropped and recorded with its group index,
field and value, so the rest of the batch still trains. What is dropped, and at which level:
- group: `tokens`/`masks`/`scores`/`inference_logprobs`/`advantages`/`overrides` lengths disagree, a score is
  NaN/inf, inference_logprobs are missing when the loss needs them, a token id is outside [0, vocab_size);
  a group whose scores are all equal (and carries no token-level advantages) is skipped as zero-variance.
- sequence (the group's other sequences still train, advantages use all its scores): no trained token, longer
  than max_seq_len with overlong="drop" (with "truncate", the default, only its first max_seq_len tokens train),
  NaN/inf sampler logprob or advantage at a trained position, a mask that names another token.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from trainer.training.losses import BatchScale

IGNORE_INDEX = -100  # Atropos's mask value for positions that are not trained


class ScoredDataGroup(BaseModel):
    """One group as run-api returns it (atroposlib 0.4.0 `ScoredData`); unknown keys are kept, not trusted."""

    model_config = ConfigDict(extra="allow")

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any] | None] | None = None
    group_overrides: dict[str, Any] | None = None
    env_id: int | None = None

    @field_validator(
        "advantages", "ref_logprobs", "messages", "inference_logprobs", "overrides", mode="before"
    )
    @classmethod
    def _empty_is_absent(cls, value: Any) -> Any:
        # atroposlib's own collect_trajectories sends [] for an optional field no item filled in.
        return None if isinstance(value, list) and not value else value


@dataclass(frozen=True)
class TrainingExample:
    """One sequence, aligned so that position t predicts target_ids[t] from input_ids[: t + 1]."""

    input_ids: list[int]
    target_ids: list[int]
    loss_mask: list[float]
    sampler_logprobs: list[float]
    advantages: list[float]
    temperature: float = 1.0
    group_index: int = -1
    sequence_index: int = -1
    score: float = 0.0

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(1 for m in self.loss_mask if m != 0)


@dataclass(frozen=True)
class Drop:
    group_index: int
    sequence_index: int | None  # None: the whole group
    field: str
    reason: str

    def __str__(self) -> str:
        where = f"group {self.group_index}" + (
            "" if self.sequence_index is None else f" seq {self.sequence_index}"
        )
        return f"{where}, field '{self.field}': {self.reason}"


@dataclass
class ConvertedBatch:
    examples: list[TrainingExample] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    groups_received: int = 0
    sequences_received: int = 0
    groups_zero_variance: int = 0
    sequences_truncated: int = 0
    scores: list[float] = field(default_factory=list)  # every finite score received, for reward metrics
    group_scores: dict[int, list[float]] = field(default_factory=dict)  # the same, by group index
    zero_variance_groups: list[int] = field(default_factory=list)
    truncated_groups: list[int] = field(default_factory=list)  # the group of each truncated sequence trained
    # Zero-variance sequences and the tokens they would train: part of the batch the mean reductions divide by.
    zero_variance_sequences: int = 0
    zero_variance_tokens: float = 0.0

    def scale(self) -> BatchScale:
        """The batch the step took, for the mean reductions: every well-formed sequence, trained or zero-variance."""
        own = BatchScale.of(self.examples)
        return BatchScale(
            own.sequences + self.zero_variance_sequences, own.tokens + self.zero_variance_tokens
        )

    def metrics(self) -> dict[str, float]:
        dropped_groups = sum(1 for d in self.drops if d.sequence_index is None)
        return {
            "rollouts/groups_received": float(self.groups_received),
            "rollouts/sequences_received": float(self.sequences_received),
            "rollouts/sequences_trained": float(len(self.examples)),
            "rollouts/groups_zero_variance": float(self.groups_zero_variance),
            "rollouts/sequences_truncated": float(self.sequences_truncated),
            "rollouts/groups_dropped_malformed": float(dropped_groups),
            "rollouts/sequences_dropped_malformed": float(len(self.drops) - dropped_groups),
            **{f"rollouts/dropped_{k}": float(v) for k, v in Counter(d.field for d in self.drops).items()},
        }


UNNAMED_ENV = "unknown"  # groups whose run-api env_id no registered environment name maps to


def env_name_of(group: Any, names: Mapping[int, str]) -> str:
    env_id = group.get("env_id") if isinstance(group, dict) else None
    return names.get(env_id, UNNAMED_ENV) if isinstance(env_id, int) else UNNAMED_ENV


def sequences_of(group: Any) -> int:
    tokens = group.get("tokens") if isinstance(group, dict) else None
    return len(tokens) if isinstance(tokens, list) else 0


def per_env_metrics(
    taken: list[Any],
    dropped: list[tuple[int, str]],
    kept: list[Any],
    converted: ConvertedBatch,
    names: Mapping[int, str],
    envs: list[str],
    kept_staleness: list[list[int]] | None = None,
) -> dict[str, float | None]:
    """A mixed run's per-environment rows: `rollouts/<env>/sequences_received|trained|dropped_<why>`, the
    environment's share of the trained sequences, and `reward/<env>/mean` over the scores it sent (as reward/mean);
    where there are any, `rollouts/<env>/sequences_truncated` and `rollouts/<env>/kept_unknown_version`.
    `taken` is the batch as run-api handed it out, `dropped` the (index in taken, why) of the groups dropped for
    their policy version, `kept` the rest (what `converted` came from); `names` maps run-api env ids to names, and
    `envs` are the run's environments, each reported even when it sent nothing; `kept_staleness` (per kept group,
    its sequences' lags in policy versions) adds `policy/<env>/staleness_mean`."""
    counts: dict[str, Counter[str]] = {name: Counter() for name in envs}
    scores: dict[str, list[float]] = {name: [] for name in envs}

    def add(group: Any, key: str, n: int) -> None:
        counts.setdefault(env_name_of(group, names), Counter())[key] += n

    for group in taken:
        add(group, "sequences_received", sequences_of(group))
    for index, why in dropped:
        add(taken[index], f"sequences_dropped_{why}", sequences_of(taken[index]))
    for example in converted.examples:
        add(kept[example.group_index], "sequences_trained", 1)
    for drop in converted.drops:
        group = kept[drop.group_index]
        add(
            group,
            "sequences_dropped_malformed",
            1 if drop.sequence_index is not None else sequences_of(group),
        )
    for gi in converted.zero_variance_groups:
        add(kept[gi], "sequences_zero_variance", sequences_of(kept[gi]))
    for gi in converted.truncated_groups:
        add(kept[gi], "sequences_truncated", 1)
    for group, group_lags in zip(kept, kept_staleness or []):  # a lag for each sequence the ledger knew
        if sequences_of(group) > len(group_lags):
            add(group, "kept_unknown_version", sequences_of(group) - len(group_lags))
    for gi, group_scores in converted.group_scores.items():
        scores.setdefault(env_name_of(kept[gi], names), []).extend(group_scores)
    lags: dict[str, list[int]] = {name: [] for name in envs}
    for group, group_lags in zip(kept, kept_staleness or []):
        lags.setdefault(env_name_of(group, names), []).extend(group_lags)
    trained = len(converted.examples)
    row: dict[str, float | None] = {}
    for name, c in counts.items():
        for key in ("sequences_received", "sequences_trained", "sequences_zero_variance"):
            c.setdefault(key, 0)
        row.update({f"rollouts/{name}/{k}": float(v) for k, v in sorted(c.items())})
        row[f"rollouts/{name}/share_trained"] = c["sequences_trained"] / trained if trained else None
        got = scores.get(name) or []
        row[f"reward/{name}/mean"] = sum(got) / len(got) if got else None
        if kept_staleness is not None:
            lag = lags.get(name) or []
            row[f"policy/{name}/staleness_mean"] = sum(lag) / len(lag) if lag else None
    return row


@dataclass(frozen=True)
class IntakeOptions:
    vocab_size: int
    max_seq_len: int
    normalize_std: bool = False
    std_eps: float = 1e-6
    require_sampler_logprobs: bool = True
    overlong: str = "truncate"  # or "drop": a sequence longer than max_seq_len
    # A group without inference_logprobs (an environment that re-tokenizes with tokenize_for_trainer): "drop" it,
    # or "recompute": its sampler logprobs are NaN here and the trainer uses its own, detached (ratio 1).
    missing_sampler_logprobs: str = "drop"
    # Distillation trains a group whose rewards are all equal: the teacher's signal does not need a reward spread.
    keep_zero_variance: bool = False


def parse_batch_response(body: Any) -> list[Any] | None:
    """The `batch` list of a run-api `GET /batch` body; None while no batch is ready."""
    if not isinstance(body, dict) or "batch" not in body:
        raise ValueError(f"run-api /batch body has no 'batch' key: {str(body)[:200]!r}")
    batch = body["batch"]
    if batch is None or batch == []:
        return None
    if not isinstance(batch, list):
        raise ValueError(f"run-api /batch 'batch' is {type(batch).__name__}, expected a list of groups")
    return batch


def compute_group_advantages(scores: list[float], normalize_std: bool, std_eps: float) -> list[float]:
    """score - group mean, optionally divided by (population std + eps)."""
    mean = sum(scores) / len(scores)
    centered = [s - mean for s in scores]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(scores))
    return [c / (std + std_eps) for c in centered]


def resolve_temperature(group: ScoredDataGroup, i: int) -> float:
    """Atropos's priority: overrides[i] > generation_params > group_overrides > 1.0."""
    for source in (
        (group.overrides[i] if group.overrides else None),
        group.generation_params,
        group.group_overrides,
    ):
        if source and source.get("temperature") is not None:
            return float(source["temperature"])
    return 1.0


def convert_batch(raw_groups: list[Any], opts: IntakeOptions) -> ConvertedBatch:
    out = ConvertedBatch()
    for gi, raw in enumerate(raw_groups):
        out.groups_received += 1
        try:
            group = ScoredDataGroup.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            out.drops.append(
                Drop(gi, None, key or "<group>", f"{err['msg']} (got {str(err.get('input'))[:80]!r})")
            )
            continue
        out.sequences_received += len(group.tokens)
        _convert_group(gi, group, opts, out)
    return out


def _check_group(gi: int, g: ScoredDataGroup, opts: IntakeOptions) -> Drop | None:
    n = len(g.tokens)
    if n == 0:
        return Drop(gi, None, "tokens", "empty group")
    per_seq_fields: dict[str, list[Any] | None] = {
        "masks": g.masks,
        "scores": g.scores,
        "inference_logprobs": g.inference_logprobs,
        "advantages": g.advantages,
        "overrides": g.overrides,
    }
    for name, value in per_seq_fields.items():
        if value is not None and len(value) != n:
            return Drop(gi, None, name, f"has {len(value)} entries for {n} sequences")
    rows: dict[str, list[list[int]] | list[list[float]] | None] = {  # per-token fields
        "masks": g.masks,
        "inference_logprobs": g.inference_logprobs,
        "advantages": g.advantages,
    }
    for name, value in rows.items():
        for si, row in enumerate(value or []):
            assert isinstance(row, list)  # pydantic validated it
            if len(row) != len(g.tokens[si]):
                return Drop(
                    gi, None, name, f"sequence {si} has {len(row)} values for {len(g.tokens[si])} tokens"
                )
    for si, score in enumerate(g.scores):
        if not math.isfinite(score):
            return Drop(gi, None, "scores", f"sequence {si} score is {score}")
    if (
        opts.require_sampler_logprobs
        and g.inference_logprobs is None
        and opts.missing_sampler_logprobs != "recompute"
    ):
        return Drop(
            gi, None, "inference_logprobs", "missing; the environment must sample through ManagedServer"
        )
    for si, toks in enumerate(g.tokens):
        bad = [t for t in toks if t < 0 or t >= opts.vocab_size]
        if bad:
            return Drop(
                gi,
                None,
                "tokens",
                f"sequence {si} has id {bad[0]} outside [0, {opts.vocab_size}): "
                "is the environment using the trainer's tokenizer?",
            )
    return None


def _convert_group(gi: int, g: ScoredDataGroup, opts: IntakeOptions, out: ConvertedBatch) -> None:
    problem = _check_group(gi, g, opts)
    if problem is not None:
        out.drops.append(problem)
        return
    out.scores.extend(g.scores)
    out.group_scores[gi] = list(g.scores)
    if g.advantages is None and max(g.scores) == min(g.scores) and not opts.keep_zero_variance:
        out.groups_zero_variance += 1
        out.zero_variance_groups.append(gi)
        for si, toks in enumerate(g.tokens):
            if len(toks) > opts.max_seq_len and opts.overlong == "drop":
                continue  # it would have been dropped, not trained
            n = min(len(toks), opts.max_seq_len)
            trained = sum(1 for m in g.masks[si][1:n] if m != IGNORE_INDEX)
            if trained:
                out.zero_variance_sequences += 1
                out.zero_variance_tokens += trained
        return
    seq_advantages = compute_group_advantages(g.scores, opts.normalize_std, opts.std_eps)
    for si in range(len(g.tokens)):
        example = _convert_sequence(gi, si, g, seq_advantages[si], opts)
        if isinstance(example, Drop):
            out.drops.append(example)
        else:
            out.examples.append(example)
            if len(g.tokens[si]) > opts.max_seq_len:
                out.sequences_truncated += 1
                out.truncated_groups.append(gi)


def _convert_sequence(
    gi: int, si: int, g: ScoredDataGroup, seq_advantage: float, opts: IntakeOptions
) -> TrainingExample | Drop:
    n = len(g.tokens[si])
    if n > opts.max_seq_len:
        if opts.overlong == "drop":
            return Drop(gi, si, "tokens", f"length {n} exceeds max_seq_len {opts.max_seq_len}")
        n = opts.max_seq_len  # the tail past the trainer's limit gets no loss; the rest trains as sampled
    tokens, masks = g.tokens[si][:n], g.masks[si][:n]
    mismatch = next(
        (t for t in range(len(tokens)) if masks[t] != IGNORE_INDEX and masks[t] != tokens[t]), None
    )
    if mismatch is not None:
        return Drop(gi, si, "masks", f"position {mismatch} is {masks[mismatch]}, token is {tokens[mismatch]}")
    # Shift by one: target t+1 is predicted at position t; position 0 is never a target.
    loss_mask = [0.0 if m == IGNORE_INDEX else 1.0 for m in masks[1:]]
    if not any(loss_mask):
        return Drop(gi, si, "masks", "no trained token (empty completion)")
    override = g.overrides[si] if g.overrides else None
    zero_adv = bool(override and override.get("set_advantage_to_zero"))
    if g.advantages is not None:
        advantages = [float(a) for a in g.advantages[si][1:n]]
    else:
        advantages = [seq_advantage] * len(loss_mask)
    if zero_adv:
        advantages = [0.0] * len(loss_mask)
    recompute = opts.require_sampler_logprobs and not g.inference_logprobs
    if g.inference_logprobs:
        sampler = [float(x) for x in g.inference_logprobs[si][1:n]]
    else:
        sampler = [math.nan if recompute else 0.0] * len(loss_mask)
    checked = [("advantages", advantages)] + ([] if recompute else [("inference_logprobs", sampler)])
    for name, values in checked:
        bad = next(
            (
                t
                for t, (m, v) in enumerate(zip(loss_mask, values, strict=False))
                if m and not math.isfinite(v)
            ),
            None,
        )
        if bad is not None:
            return Drop(gi, si, name, f"{values[bad]} at trained position {bad + 1}")
    return TrainingExample(
        input_ids=list(tokens[:-1]),
        target_ids=list(tokens[1:]),
        loss_mask=loss_mask,
        sampler_logprobs=[v if m else 0.0 for m, v in zip(loss_mask, sampler, strict=False)],
        advantages=[v if m else 0.0 for m, v in zip(loss_mask, advantages, strict=False)],
        temperature=resolve_temperature(g, si),
        group_index=gi,
        sequence_index=si,
        score=g.scores[si],
    )


def examples_to_tensors(examples: list[TrainingExample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors; padding has loss_mask 0."""
    width = max(len(e) for e in examples)
    B = len(examples)
    input_ids_BT = torch.full((B, width), pad_id, dtype=torch.long)
    target_ids_BT = torch.full((B, width), pad_id, dtype=torch.long)
    attention_BT = torch.zeros((B, width), dtype=torch.long)
    mask_BT = torch.zeros((B, width), dtype=torch.float32)
    sampler_BT = torch.zeros((B, width), dtype=torch.float32)
    adv_BT = torch.zeros((B, width), dtype=torch.float32)
    temperature_B = torch.ones(B, dtype=torch.float32)
    for b, e in enumerate(examples):
        n = len(e)
        input_ids_BT[b, :n] = torch.tensor(e.input_ids)
        target_ids_BT[b, :n] = torch.tensor(e.target_ids)
        attention_BT[b, :n] = 1
        mask_BT[b, :n] = torch.tensor(e.loss_mask)
        sampler_BT[b, :n] = torch.tensor(e.sampler_logprobs)
        adv_BT[b, :n] = torch.tensor(e.advantages)
        temperature_B[b] = e.temperature
    return {
        "input_ids_BT": input_ids_BT,
        "target_ids_BT": target_ids_BT,
        "attention_mask_BT": attention_BT,
        "mask_BT": mask_BT,
        "sampler_logprobs_BT": sampler_BT,
        "advantages_BT": adv_BT,
        "temperature_B": temperature_B,
    }


def earlier_turn_ends(masks: Any) -> list[int]:
    """Where a multi-turn sequence's earlier sampled turns end: the prefix lengths after each run of trained
    positions (mask != IGNORE_INDEX) that an environment turn (IGNORE_INDEX) follows. Each such prefix is what the
    sampler answered at that turn (its prompt and reply), so it has a policy version of its own. A single-turn
    sequence: []."""
    if not isinstance(masks, list):
        return []
    return [t for t in range(1, len(masks)) if masks[t - 1] != IGNORE_INDEX and masks[t] == IGNORE_INDEX]


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group example indices so that (count x longest) padded tokens stay within token_budget.

    Longest first, so similar lengths share a micro-batch and padding stays small. An example longer than the
    budget gets a micro-batch of its own (config validation keeps max_seq_len within the budget).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # longest in current, since sorted descending
        if current and (len(current) + 1) * width > token_budget:
            plans.append(current)
            current = []
        current.append(i)
    if current:
        plans.append(current)
    return plans
