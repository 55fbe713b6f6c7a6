"""The toy task (environments/toy.py's reward, written again for verifiers' API) as a verifiers v0 environment of our
own, offline: the dataset is built in code and the reward reads the sampled token ids from the rollout's state.

    bash launch.sh vf:tests/envs/vf_toy.py --config configs/tiny_cpu.yaml

Reward: the share of max_new_tokens completion tokens (up to the first EOS) drawn from a fixed 10% of the vocabulary,
special ids excluded; a random tiny model scores about 0.1. `turns` > 1 makes it a MultiTurnEnv whose user answers
"Go on." after each reply (the reward then averages the turns), for the multi-turn path.

The runner passes the run's tokenizer folder as `tokenizer_name` (this load_environment declares it).
"""

from __future__ import annotations

import random
from typing import Any

import verifiers as vf
from datasets import Dataset
from transformers import AutoTokenizer

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
EVAL_PROMPTS = ["Describe the sea.", "Name an animal.", "Write a short poem.", "What is a tree?"]


def target_ids(vocab_size: int, special: set[int], fraction: float, seed: int) -> frozenset[int]:
    candidates = [i for i in range(vocab_size) if i not in special]
    return frozenset(random.Random(seed).sample(candidates, max(1, round(fraction * vocab_size))))


def toy_reward(ids: list[int], targets: frozenset[int], eos: set[int], max_new_tokens: int) -> float:
    hits = 0
    for token in ids:
        if token in eos:
            break
        hits += token in targets
    return hits / max_new_tokens


class GoOnEnv(vf.MultiTurnEnv):
    """Each reply is answered with a fixed user turn until max_turns model calls."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        return [{"role": "user", "content": "Go on."}]


def load_environment(
    tokenizer_name: str,
    target_fraction: float = 0.1,
    target_seed: int = 1234,
    max_new_tokens: int = 16,
    turns: int = 1,
) -> vf.Environment:
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    eos = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)}
    targets = target_ids(len(tok), set(tok.all_special_ids) | eos, target_fraction, target_seed)

    def sampled_share(state: Any, **kwargs: Any) -> float:
        steps = state["trajectory"]
        rewards = [
            toy_reward(list(step["tokens"]["completion_ids"]), targets, eos, max_new_tokens)
            for step in steps
            if step.get("tokens") is not None
        ]
        return sum(rewards) / len(rewards) if rewards else 0.0

    # Numbered, as a real dataset's rows are distinct: groups sampled at once never share a prompt (the gateway's
    # on-policy gate admits a prompt's rollouts as one group).
    rows = [f"{p} ({i})" for i in range(8) for p in PROMPTS]
    dataset = Dataset.from_list([{"question": p, "answer": ""} for p in rows])
    eval_dataset = Dataset.from_list([{"question": p, "answer": ""} for p in EVAL_PROMPTS])
    rubric = vf.Rubric(funcs=[sampled_share])
    if turns > 1:
        return GoOnEnv(dataset=dataset, eval_dataset=eval_dataset, rubric=rubric, max_turns=turns)
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=eval_dataset, rubric=rubric)
