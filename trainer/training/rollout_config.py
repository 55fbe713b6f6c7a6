"""The rollout section: the environment(s) a run samples from, mixing, group sizes, staleness, the refill."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rlcommon.lora_slots import DEFAULT_MAX_STALENESS
from trainer.training.config_base import Section

MIX_WAIT_S_DEFAULT = 30.0  # rollout.mix_wait_s's default, also run-api's when started without the launcher


class EnvEntry(Section):
    """One environment of a mixed run (`rollout.envs`); unset fields take the rollout section's value."""

    env: str = Field(
        ...,
        description="environments/<name>.py, a path to any Atropos environment file, or vf:<id or file.py> (a "
        "verifiers environment)",
    )
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the environment's name in metrics (reward/<name>/mean) and logs; None = the env's stem",
    )
    weight: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="relative share of every batch: run-api fills each batch with weight / sum(weights) of its "
        "sequences from this environment first (whole groups), the rest with the oldest groups of any",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="extra --env.<key> <value> flags of this environment"
    )
    group_size: int | None = Field(None, ge=1, description="samples per prompt; None = rollout.group_size")
    max_token_length: int | None = Field(
        None, ge=2, description="prompt+completion limit; None = rollout.max_token_length"
    )
    workers: int | None = Field(
        None, ge=1, description="processes of this environment; None = rollout.env_workers"
    )


VERIFIERS_PREFIX = "vf:"  # rollout.env=vf:ID names a verifiers environment


@dataclass(frozen=True)
class EnvSpec:
    """One environment of the run with every setting resolved: what commands, metrics and evaluation iterate."""

    name: str
    env: str
    weight: float
    share: float  # weight / sum of weights: the fraction of each batch it is allotted
    env_args: dict[str, Any]
    group_size: int
    max_token_length: int
    workers: int

    @property
    def is_verifiers(self) -> bool:
        """`vf:<id or file.py>`: a verifiers environment, run by environments.verifiers_runner in its own venv."""
        return self.env.startswith(VERIFIERS_PREFIX)

    @property
    def is_file(self) -> bool:
        return not self.is_verifiers and self.env.endswith(".py")

    def batch_sequences(self, batch_size: int) -> int:
        """Sequences run-api fills each batch with from this environment first: its share, up to whole groups."""
        return math.ceil(int(batch_size * self.share) / self.group_size) * self.group_size


class RolloutConfig(Section):
    env: str = Field(
        "toy",
        description="environments/<name>.py, a path to any Atropos environment file, or vf:<id or file.py> (a "
        "verifiers environment; the one-environment case; "
        "rollout.envs mixes several)",
    )
    envs: list[EnvEntry] = Field(
        default_factory=list,
        description="several environments mixed in one run by weight (each: env, name, weight, env_args, "
        "group_size, max_token_length, workers); empty = rollout.env alone",
    )
    group_size: int = Field(8, ge=1, description="samples per prompt (Atropos group_size)")
    groups_per_step: int = Field(
        8, ge=1, description="groups per optimizer step; batch = groups x group_size"
    )
    max_staleness: int = Field(
        DEFAULT_MAX_STALENESS,
        ge=0,
        description="policy versions a trained rollout may lag; 0 = on-policy (the gateway keeps as many loaded "
        "unless inference.keep_versions says otherwise)",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature the environment requests")
    max_new_tokens: int = Field(256, ge=1, description="completion length limit, tokens")
    max_token_length: int = Field(2048, ge=2, description="prompt+completion limit the environment enforces")
    num_steps: int = Field(100, ge=1, description="optimizer steps in the run")
    env_workers: int = Field(1, ge=1, description="environment processes")
    max_batches_offpolicy: int | None = Field(
        None,
        ge=1,
        description="batches the env may keep queued or in flight; None = max(1, max_staleness), "
        "or max(1, max_staleness - 1) in a mixed run (rollout.envs)",
    )
    env_args: dict[str, Any] = Field(default_factory=dict, description="extra --env.<key> <value> flags")
    missing_logprobs: Literal["recompute", "drop"] = Field(
        "recompute",
        description="a group without inference_logprobs (tokenize_for_trainer environments): the local trainer "
        "uses its own logprobs as the sampler's (importance ratio 1, exact on-policy), or drops the group; "
        "the Tinker backend always drops",
    )
    unknown_version: Literal["keep", "drop"] = Field(
        "keep",
        description="sequences the gateway's ledger never saw (an environment that re-tokenizes a multi-turn "
        "chat): keep them (their lag is bounded by max_batches_offpolicy) or drop them",
    )
    seed: int = Field(0, description="environment data seed")
    mix_wait_s: float = Field(
        MIX_WAIT_S_DEFAULT,
        gt=0,
        description="a mixed run: a batch forms once every environment has its whole share queued; once the "
        "trainer has waited this long for one that an environment short of its share holds back, it forms without "
        "that environment's share (the shortfall is counted)",
    )
    refill_zero_variance: bool = Field(
        False,
        description="dynamic sampling: leave out groups whose rewards are all equal (zero advantage, no gradient) "
        "and give their places to further groups before the step trains, up to rollout.refill_max_groups per step; "
        "groups a step does not need wait for the next one",
    )
    refill_max_groups: int | None = Field(
        None,
        ge=1,
        description="equal-reward groups a step may leave out with rollout.refill_zero_variance; past it the step "
        "trains what it has (a solved task cannot stall the run); None = rollout.groups_per_step",
    )

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    @model_validator(mode="after")
    def _check_envs(self) -> RolloutConfig:
        if not self.envs:
            return self
        # A resolved config written back to a file carries the default rollout.env beside rollout.envs.
        if self.env != RolloutConfig.model_fields["env"].default:
            raise ValueError(
                f"rollout.env={self.env!r} and rollout.envs are both set: rollout.envs names every environment of "
                "the run; drop rollout.env (and the ENV argument of launch.sh)"
            )
        seen: dict[str, int] = {}
        for i, spec in enumerate(self.env_specs()):
            if spec.name in seen:
                raise ValueError(
                    f"rollout.envs.{i}: name {spec.name!r} is already rollout.envs.{seen[spec.name]}'s; give one of "
                    "them another name (its `name:`) so metrics and logs can tell them apart"
                )
            seen[spec.name] = i
            if self.batch_size % spec.group_size:
                raise ValueError(
                    f"rollout.envs.{i} ({spec.name}): group_size={spec.group_size} does not divide the batch "
                    f"(rollout.group_size x groups_per_step = {self.batch_size}); run-api would never form a batch"
                )
        return self

    def env_specs(self) -> list[EnvSpec]:
        """Every environment of the run, resolved; rollout.env alone is one entry of weight 1 (share 1.0)."""
        entries = self.envs or [
            EnvEntry(
                env=self.env, env_args=self.env_args, workers=self.env_workers
            )  # the one-environment case
        ]
        total = math.fsum(e.weight for e in entries)
        return [
            EnvSpec(
                name=e.name or Path(e.env.removeprefix(VERIFIERS_PREFIX)).stem,
                env=e.env,
                weight=e.weight,
                share=e.weight / total,
                env_args=e.env_args,
                group_size=e.group_size or self.group_size,
                max_token_length=e.max_token_length or self.max_token_length,
                workers=e.workers or self.env_workers,
            )
            for e in entries
        ]

    @property
    def mixed(self) -> bool:
        return len(self.envs) > 1

    def env_processes(self) -> list[tuple[str, EnvSpec, int]]:
        """(component name, environment, worker index) of every environment process: `env` or `env-<w>` for
        rollout.env alone, `env-<name>` or `env-<name>-<w>` for each entry of rollout.envs."""
        out = []
        for spec in self.env_specs():
            base = f"env-{spec.name}" if self.envs else "env"
            for w in range(spec.workers):
                out.append((base if spec.workers == 1 else f"{base}-{w}", spec, w))
        return out
