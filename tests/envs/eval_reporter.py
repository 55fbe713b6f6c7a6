"""Conformance environment (written here, not copied): the three ways upstream Atropos environments report an
evaluation, in one small file that imports only atroposlib, as an upstream file does.

- evaluate() samples a few held-out prompts through `self.server.completion(..., split="eval")` (plain OpenAI
  completions, as most upstream evals do) and reports
  1. `self.wandb_log({...})` directly, with a value W&B could take but JSON cannot (a list);
  2. `self.eval_metrics`, the buffer upstream environments fill in evaluate() for their wandb_log override to log
     on the serve loop's next call (an evaluate run never makes one);
  3. `self.evaluate_log(...)`, atroposlib's metrics.json and samples.jsonl.
- Training is trivial: a ManagedServer group scored by the share of even token ids.

Accuracy: the share of eval replies that contain a vowel.
"""

from __future__ import annotations

import time
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

EVAL_PROMPTS = ["Name a bird.", "Say a color.", "Give a verb.", "Pick a fruit."]


class EvalReporterConfig(BaseEnvConfig):
    reply_tokens: int = Field(6, description="max_tokens of each reply")


class EvalReporterEnv(BaseEnv):
    name = "eval_reporter"
    env_config_cls = EvalReporterConfig  # type: ignore[assignment]

    @classmethod
    def config_init(cls) -> tuple[EvalReporterConfig, APIServerConfig]:  # type: ignore[override]
        config = EvalReporterConfig(
            tokenizer_name="gpt2", group_size=4, use_wandb=False, max_token_length=512, steps_per_eval=0
        )
        return config, APIServerConfig(model_name="any", base_url="http://localhost:9001/v1", api_key="x")

    async def setup(self) -> None:
        self.eval_metrics: list[tuple[str, float]] = []

    async def get_next_item(self) -> str:
        return "Count:"

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup | None, list[Any]]:
        cfg: Any = self.config
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(
                prompt=item, n=cfg.group_size, max_tokens=cfg.reply_tokens, temperature=1.0
            )
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for node in nodes:
            completion = [t for t in node.masked_tokens if t != -100]
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(sum(t % 2 == 0 for t in completion) / max(1, len(completion)))
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        cfg: Any = self.config
        start = time.time()
        replies = []
        for prompt in EVAL_PROMPTS:
            out = await self.server.completion(
                prompt=prompt, n=1, max_tokens=cfg.reply_tokens, temperature=0.0, split="eval"
            )
            replies.append(out.choices[0].text or "")
        hits = [any(c in "aeiou" for c in reply.lower()) for reply in replies]
        accuracy = sum(hits) / len(hits)
        await self.wandb_log(
            {"conformance/accuracy": accuracy, "conformance/items": len(hits), "conformance/replies": replies}
        )
        self.eval_metrics.append(("conformance/buffered_accuracy", accuracy))
        await self.evaluate_log(
            {"conformance/accuracy": accuracy, "conformance/items": len(hits)},
            task_name="eval_reporter",
            start_time=start,
            end_time=time.time(),
            samples=[{"prompt": p, "reply": r, "hit": h} for p, r, h in zip(EVAL_PROMPTS, replies, hits)],
        )

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        wandb_metrics = dict(wandb_metrics or {})
        for key, value in self.eval_metrics:
            wandb_metrics[key] = value
        self.eval_metrics = []
        await super().wandb_log(wandb_metrics)


if __name__ == "__main__":
    EvalReporterEnv.cli()
