"""Conformance environment (written here, not copied): ManagedServer patterns of upstream Atropos environments,
in one small file that imports only atroposlib, as an upstream file does.

- config_init returns a list of two server configs: atroposlib refuses --openai.* flags for such a list.
- A multi-turn chat through `managed_server(...).chat_completion`, whose state (one node per episode: tokens,
  masks, sampler logprobs) becomes the group.
- `managed.get_logprobs(input_ids=...)` (prompt_logprobs on /generate) scores each finished conversation.
- Its config declares `seed` and `temperature` (so launch.sh's flags for them are passed, and used).

Score: minus the mean prompt logprob the sampler gives the conversation, a number that varies per episode.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field


class ManagedTurnsConfig(BaseEnvConfig):
    seed: int = Field(0, description="topic order")
    temperature: float = Field(1.0, description="sampling temperature")
    reply_tokens: int = Field(5, description="max_tokens of each reply")


class ManagedTurnsEnv(BaseEnv):
    name = "managed_turns"
    env_config_cls = ManagedTurnsConfig  # type: ignore[assignment]

    @classmethod
    def config_init(cls) -> tuple[ManagedTurnsConfig, list[APIServerConfig]]:
        config = ManagedTurnsConfig(
            tokenizer_name="gpt2", group_size=4, use_wandb=False, max_token_length=1024, steps_per_eval=0
        )
        servers = [
            APIServerConfig(model_name="any", base_url=f"http://localhost:{port}/v1", api_key="x")
            for port in (9001, 9002)
        ]
        return config, servers

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)  # type: ignore[attr-defined]

    async def get_next_item(self) -> str:
        return self.rng.choice(["boats", "snow", "bread", "clocks"])

    async def episode(self, topic: str) -> tuple[Any, float]:
        cfg: Any = self.config
        messages = [{"role": "user", "content": f"Say a word about {topic}."}]
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            for _ in range(2):
                reply = await managed.chat_completion(
                    messages=messages, n=1, max_tokens=cfg.reply_tokens, temperature=cfg.temperature
                )
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": "Another."},
                ]
            node = managed.get_state()["nodes"][-1]
            scored = await managed.get_logprobs(input_ids=list(node.tokens), top_k=1)
        logprobs = [row[0] for row in scored["prompt_topk_logprobs"][1:] if row]
        return node, -sum(logprobs) / max(1, len(logprobs))

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup | None, list[Any]]:
        episodes = await asyncio.gather(*(self.episode(item) for _ in range(self.config.group_size)))
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for node, score in episodes:
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(score)
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


if __name__ == "__main__":
    ManagedTurnsEnv.cli()
