"""The toy task (environments/toy.py's reward: the share of a completion's tokens drawn from a fixed 10% of the
vocabulary) as a tinker-cookbook RL environment, and the tiny model's tokenizer registered under the service's model
name, so the cookbook's own loops run on the local service unchanged. Imported only where tinker_cookbook is
installed (tests/run.sh installs it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl.types import (
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.tokenizer_utils import (
    Tokenizer,
    get_tokenizer,
    is_tokenizer_registered,
    register_tokenizer,
)

from environments.toy import compute_target_ids, compute_toy_reward
from trainer.backends.tiny_model import ensure_tiny_model

MODEL = "tiny"  # the base model configs/tiny_cpu.yaml serves
RENDERER = "role_colon"  # the cookbook's renderer that needs nothing from the tokenizer but encode/decode


def register_tiny_tokenizer() -> None:
    """The cookbook loads a tokenizer by model name (from the Hub unless registered): the offline tiny one here."""
    if not is_tokenizer_registered(MODEL):
        from transformers import AutoTokenizer

        path = ensure_tiny_model()
        register_tokenizer(MODEL, lambda: AutoTokenizer.from_pretrained(path))


@cache
def toy_reward_parts() -> tuple[frozenset[int], set[int]]:
    """The rewarded token ids and the end-of-sequence ids, as environments/toy.py picks them for this tokenizer."""
    tok = get_tokenizer(MODEL)
    eos = {tok.eos_token_id}
    return compute_target_ids(len(tok), set(tok.all_special_ids) | eos, 0.1, 1234), eos


def toy_reward(tokens: list[int], max_tokens: int) -> float:
    targets, eos = toy_reward_parts()
    return compute_toy_reward(tokens, targets, eos, max_tokens)


def toy_text_reward(text: str, max_tokens: int) -> float:
    """The toy reward of a decoded completion (for loops that grade text, as the cookbook's rl_loop does)."""
    tok: Tokenizer = get_tokenizer(MODEL)
    return toy_reward(tok.encode(text, add_special_tokens=False), max_tokens)


class ToyEnv(Env):
    """One prompt, one completion, rewarded by the toy task."""

    def __init__(self, prompt: str, max_tokens: int):
        self.renderer = renderers.get_renderer(RENDERER, get_tokenizer(MODEL))
        self.prompt, self.max_tokens = prompt, max_tokens

    async def initial_observation(self) -> tuple[tinker.ModelInput, list[str]]:
        model_input = self.renderer.build_generation_prompt([{"role": "user", "content": self.prompt}])
        return model_input, self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        return StepResult(
            reward=toy_reward(action, self.max_tokens),
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
        )


@dataclass(frozen=True)
class ToyGroupBuilder(EnvGroupBuilder):
    prompt: str
    group_size: int
    max_tokens: int

    async def make_envs(self) -> Sequence[Env]:
        return [ToyEnv(self.prompt, self.max_tokens) for _ in range(self.group_size)]


class ToyDataset(RLDataset):
    def __init__(self, batches: int, groups_per_batch: int, group_size: int, max_tokens: int):
        self.batches, self.groups_per_batch = batches, groups_per_batch
        self.group_size, self.max_tokens = group_size, max_tokens

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        # The same prompts every step: the reward curve then measures learning, not prompt difficulty.
        return [
            ToyGroupBuilder(f"Say something number {i}.", self.group_size, self.max_tokens)
            for i in range(self.groups_per_batch)
        ]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class ToyDatasetBuilder(RLDatasetBuilder):
    batches: int
    groups_per_batch: int
    group_size: int
    max_tokens: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return ToyDataset(self.batches, self.groups_per_batch, self.group_size, self.max_tokens), None
