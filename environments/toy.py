"""Toy Atropos environment a tiny random model learns on CPU in tens of steps: the reward is the share of the
completion (up to the first EOS, out of max_new_tokens) drawn from a fixed 10% subset of the vocabulary.
Special tokens are never in the subset, so an EOS-only completion scores 0.

    python -m environments.toy serve --env.rollout_server_url=... --openai.base_url=.../v1 ...   (launch.sh does it)
    python -m environments.toy evaluate --openai.base_url=.../v1 --env.data_dir_to_save_evals=DIR [--env.eval_k=4 ...]

Eval: EVAL_PROMPTS, disjoint from the training PROMPTS, each sampled eval_k times; a sample passes at reward >= 0.5.
"""

from __future__ import annotations

import random
from typing import Any

from atroposlib.envs.base import BaseEnvConfig, ScoredDataGroup
from pydantic import Field

from environments.common import (
    ResumableData,
    Sampled,
    completion_ids,
    eval_max_new_tokens,
    evaluate_items,
    group_from_nodes,
    run_cli,
)
from environments.evaluation import EvalSettings

PROMPTS = [
    "Say something.",
    "Tell me a story.",
    "Write a line.",
    "Count to three.",
    "Name a color.",
    "What is a cat?",
    "Give me a word.",
    "Finish this:",
]
EVAL_PROMPTS = [
    "Describe the sea.",
    "Name an animal.",
    "Write a short poem.",
    "What is a tree?",
    "Say hello.",
    "List two fruits.",
    "Tell me a fact.",
    "Pick a number.",
    "Describe your day.",
    "What is rain?",
    "Give me a name.",
    "Continue this:",
    "Name a city.",
    "What is music?",
    "Write a sentence.",
    "Say goodbye.",
]
# A random policy draws about target_fraction (10%) of its tokens from the targets, a reward near 0.1; a sample at
# 0.5 or more means the policy has learned to prefer them, so that is what passing means here.
PASS_REWARD = 0.5


def compute_target_ids(vocab_size: int, special_ids: set[int], fraction: float, seed: int) -> frozenset[int]:
    candidates = [i for i in range(vocab_size) if i not in special_ids]
    k = max(1, round(fraction * vocab_size))
    return frozenset(random.Random(seed).sample(candidates, k))


def compute_toy_reward(
    completion_ids: list[int], targets: frozenset[int], eos_ids: set[int], max_new_tokens: int
) -> float:
    hits = 0
    for token in completion_ids:
        if token in eos_ids:
            break
        hits += token in targets
    return hits / max_new_tokens


class ToyEnvConfig(BaseEnvConfig, EvalSettings):
    temperature: float = Field(1.0, description="sampling temperature")
    max_new_tokens: int = Field(16, description="completion length; the reward's denominator")
    target_fraction: float = Field(0.1, description="share of the vocabulary that earns reward")
    target_seed: int = Field(1234, description="seed choosing the rewarded tokens")
    seed: int = Field(0, description="prompt order seed")


class ToyEnv(ResumableData):
    name = "toy"
    data_position = ("next_index",)
    env_config_cls = ToyEnvConfig  # type: ignore[assignment]

    default_max_token_length = 256

    async def setup(self) -> None:
        cfg: Any = self.config
        tok = self.tokenizer
        special = set(tok.all_special_ids)
        self.eos_ids = {
            i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if i is not None
        }
        self.targets = compute_target_ids(
            len(tok), special | self.eos_ids, cfg.target_fraction, cfg.target_seed
        )
        self.prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in PROMPTS
        ]
        self.eval_prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in EVAL_PROMPTS
        ]
        self.rng = random.Random(cfg.seed)
        self.next_index = 0

    async def get_next_item(self) -> str:
        prompt = self.prompts[self.next_index % len(self.prompts)]
        self.next_index += 1
        return prompt

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup | None, list[Any]]:
        cfg: Any = self.config
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(
                prompt=item, n=cfg.group_size, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature
            )
            nodes = managed.get_state()["nodes"]
        scores = [
            compute_toy_reward(completion_ids(n), self.targets, self.eos_ids, cfg.max_new_tokens)
            for n in nodes
        ]
        return group_from_nodes(nodes, scores), []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        await evaluate_items(self, self.eval_prompts, self.eval_samples, PASS_REWARD, "toy")

    async def eval_samples(self, prompt: str) -> list[Sampled]:
        cfg: Any = self.config
        max_new = eval_max_new_tokens(cfg)
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(
                prompt=prompt,
                n=cfg.eval_k,
                max_tokens=max_new,
                temperature=cfg.eval_temperature,
                split="eval",
            )
            nodes = managed.get_state()["nodes"]
        samples = []
        for node in nodes:
            ids = completion_ids(node)
            reward = compute_toy_reward(ids, self.targets, self.eos_ids, max_new)
            samples.append((reward, {"prompt": prompt, "completion_ids": ids}))
        return samples


if __name__ == "__main__":
    run_cli(ToyEnv)
