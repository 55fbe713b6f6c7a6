"""The toy task (environments/toy.py's prompts and reward) as a verifiers v1 taskset of our own, offline: the tasks
are built in code, the reward reads the sampled token ids from the trace, and the harness is the runner's in-process
plain chat harness (exported here, so verifiers takes it as this taskset's own; see
environments/verifiers_v1_runner/chat_harness.py for why not verifiers' `null`).

    bash launch.sh vf:tests/envs/vf1_toy.py --config configs/tiny_cpu.yaml

Reward: the share of max_new_tokens completion tokens (up to the first EOS) drawn from a fixed 10% of the
vocabulary, special ids excluded; a random tiny model scores about 0.1. The runner fills `tokenizer_name` with the
run's tokenizer folder (this taskset's config declares it); rollout.env_args set the other config keys.
"""

from __future__ import annotations

import functools

import verifiers.v1 as vf
from transformers import AutoTokenizer

from environments.toy import PROMPTS, compute_target_ids, compute_toy_reward
from environments.verifiers_v1_runner.chat_harness import ChatHarness


@functools.cache
def targets_and_eos(tokenizer_name: str, fraction: float, seed: int) -> tuple[frozenset[int], frozenset[int]]:
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    eos = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)}
    return compute_target_ids(len(tok), set(tok.all_special_ids) | eos, fraction, seed), frozenset(eos)


class ToyData(vf.TaskData):
    tokenizer_name: str
    target_fraction: float
    target_seed: int
    max_new_tokens: int


class ToyTask(vf.Task[ToyData]):
    @vf.reward(weight=1.0)
    async def sampled_share(self, trace: vf.Trace) -> float:
        d = self.data
        targets, eos = targets_and_eos(d.tokenizer_name, d.target_fraction, d.target_seed)
        turns = [
            [t for t, sampled in zip(node.token_ids, node.mask, strict=True) if sampled]
            for node in trace.nodes
            if node.sampled
        ]
        rewards = [compute_toy_reward(ids, targets, set(eos), d.max_new_tokens) for ids in turns]
        return sum(rewards) / len(rewards) if rewards else 0.0


class ToyConfig(vf.TasksetConfig):
    tokenizer_name: str = ""
    target_fraction: float = 0.1
    target_seed: int = 1234
    max_new_tokens: int = 16


class ToyTaskset(vf.Taskset[ToyTask, ToyConfig]):
    def load(self) -> list[ToyTask]:
        c = self.config
        if not c.tokenizer_name:
            raise ValueError("vf1_toy needs tokenizer_name (the runner passes the run's tokenizer folder)")
        return [
            ToyTask(
                ToyData(
                    prompt=p,
                    tokenizer_name=c.tokenizer_name,
                    target_fraction=c.target_fraction,
                    target_seed=c.target_seed,
                    max_new_tokens=c.max_new_tokens,
                ),
                c.task,
            )
            for p in PROMPTS
        ]


__all__ = ["ChatHarness", "ToyTaskset"]
