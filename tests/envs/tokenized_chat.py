"""Conformance environment (written here, not copied): the upstream patterns that kept Atropos environments from
training through launch.sh, in one small file that imports only atroposlib, as an upstream file does.

- Its config class declares no `seed`, `temperature` or `max_new_tokens` (launch.sh derives those flags).
- config_init returns one bare APIServerConfig, not a list: atroposlib rewrites that to localhost:9004-9007.
- A two-turn chat through `self.server.chat_completion` with `stop=[<eos id>]`, an integer (vLLM wants
  stop_token_ids), and tokens/masks from `tokenize_for_trainer` (transformers 5 returns a BatchEncoding there),
  so groups carry no inference_logprobs and their re-tokenized sequences are unknown to the gateway's ledger.
- One collect_trajectory per sequence: BaseEnv's own collect_trajectories sends [] for unfilled optional fields.
- `system_words` pads the system prompt, for the pre-flight's prompt-length check.

Score: the share of vowels in the replies (a random tiny model's replies vary, so groups have variance).
"""

from __future__ import annotations

import random
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataItem
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer
from pydantic import Field


class TokenizedChatConfig(BaseEnvConfig):
    turns: int = Field(2, description="assistant turns per episode")
    reply_tokens: int = Field(6, description="max_tokens of each reply")
    system_words: int = Field(0, description="extra words in the system prompt")


class TokenizedChatEnv(BaseEnv):
    name = "tokenized_chat"
    env_config_cls = TokenizedChatConfig  # type: ignore[assignment]

    @classmethod
    def config_init(cls) -> tuple[TokenizedChatConfig, APIServerConfig]:  # type: ignore[override]
        config = TokenizedChatConfig(
            tokenizer_name="gpt2", group_size=4, use_wandb=False, max_token_length=1024, steps_per_eval=0
        )
        return config, APIServerConfig(model_name="any", base_url="http://localhost:9001/v1", api_key="x")

    async def setup(self) -> None:
        self.rng = random.Random(7)

    async def get_next_item(self) -> dict[str, Any]:
        return {"topic": self.rng.choice(["cats", "rain", "maps", "tea"])}

    async def collect_trajectory(self, item: dict[str, Any]) -> tuple[ScoredDataItem | None, list[Any]]:
        cfg: Any = self.config
        system = "Answer briefly." + " please" * cfg.system_words
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Talk about {item['topic']}."},
        ]
        finish_reason = ""
        for turn in range(cfg.turns):
            reply = await self.server.chat_completion(
                messages=messages, n=1, max_tokens=cfg.reply_tokens, stop=[self.tokenizer.eos_token_id]
            )
            choice = reply.choices[0]
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            finish_reason = choice.finish_reason or ""
            if turn + 1 < cfg.turns:
                messages.append({"role": "user", "content": "And then?"})
        out = tokenize_for_trainer(self.tokenizer, messages, finish_reason=finish_reason)
        replies = "".join(m["content"] for m in messages if m["role"] == "assistant")
        vowels = sum(c in "aeiou" for c in replies.lower()) / max(1, len(replies))
        return ScoredDataItem(tokens=out["tokens"], masks=out["masks"], scores=vowels), []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


if __name__ == "__main__":
    TokenizedChatEnv.cli()
