"""A second toy task (written here, not copied), for runs that mix environments: the reward is the share of the
completion (up to the first EOS, out of max_new_tokens) made of tokens whose id leaves `residue` when divided by
`modulus`: about 10% of the vocabulary, a set other than environments/toy.py's random targets. A random policy
scores about 0.1; a policy that learned the task approaches 1. Its prompts differ from the toy task's, so a
policy can tell the two tasks apart. Imports only atroposlib, as an upstream environment file does; runs through
environments.upstream like any env file.
"""

from __future__ import annotations

from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

PROMPTS = ["Spell a number.", "Make a list.", "Write code.", "Draw a map.", "Sing a note.", "Build a wall."]


def residue_reward(
    completion: list[int], modulus: int, residue: int, eos: set[int], max_new_tokens: int
) -> float:
    hits = 0
    for token in completion:
        if token in eos:
            break
        hits += token % modulus == residue
    return hits / max_new_tokens


class ResidueConfig(BaseEnvConfig):
    temperature: float = Field(1.0, description="sampling temperature")
    max_new_tokens: int = Field(16, description="completion length; the reward's denominator")
    modulus: int = Field(10, description="rewarded tokens: id % modulus == residue")
    residue: int = Field(3, description="rewarded tokens: id % modulus == residue")
    seed: int = Field(0, description="first prompt")


class ResidueEnv(BaseEnv):
    name = "residue_tokens"
    env_config_cls = ResidueConfig  # type: ignore[assignment]

    @classmethod
    def config_init(cls) -> tuple[ResidueConfig, list[APIServerConfig]]:
        config = ResidueConfig(
            tokenizer_name="gpt2",
            group_size=8,
            use_wandb=False,
            max_token_length=256,
            steps_per_eval=0,
            ensure_scores_are_not_same=False,
        )
        return config, [APIServerConfig(model_name="any", base_url="http://localhost:9001/v1", api_key="x")]

    async def setup(self) -> None:
        tok = self.tokenizer
        self.eos = {
            i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)
        }
        self.next_index = self.config.seed  # type: ignore[attr-defined]

    async def get_next_item(self) -> str:
        prompt = PROMPTS[self.next_index % len(PROMPTS)]
        self.next_index += 1
        return prompt

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup | None, list[Any]]:
        cfg: Any = self.config
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(
                prompt=item, n=cfg.group_size, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature
            )
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for node in nodes:
            completion = [t for t in node.masked_tokens if t != -100]
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(
                residue_reward(completion, cfg.modulus, cfg.residue, self.eos, cfg.max_new_tokens)
            )
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


if __name__ == "__main__":
    ResidueEnv.cli()
