"""A verifiers (v0, 0.1.x) environment as an Atropos environment process: atroposlib's BaseEnv registers with
run-api, paces itself (max_batches_offpolicy, a mixed run's share) and posts the groups; verifiers runs each group's
rollouts against the gateway's OpenAI chat (or completions) route and scores them with its rubric. Runs in the
verifiers venv (launch.sh builds it when a `vf:` environment is named); nothing else imports this module.

The exact tokens: every model call asks for `logprobs=true` and vLLM's `return_token_ids`, so verifiers records the
prompt ids vLLM rendered, the sampled ids and their logprobs per turn; environments.verifiers_runner.trajectory
turns those into the sequence run-api receives. The gateway records each answer in its version ledger, where the
trainer looks the sequence up.

Token-in later turns: a multi-turn chat environment without tools sends every turn after the first as token ids
(the earlier turns' ids exactly as sampled, then the environment's turn tokenized by the gateway's /tokenize) to
the gateway's /v1/chat/completions/tokens, whenever the gateway serves /tokenize. Each prompt then begins with
everything before it, so the whole rollout trains as one sequence. environments.verifiers_runner.compat hides how
0.1.9.post2 and 0.1.14 switch it on.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import random
import sys
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

import verifiers as vf
from atroposlib.envs.base import BaseEnvConfig, ScoredDataGroup
from openai import APIStatusError, AsyncOpenAI
from pydantic import Field

from environments.common import ModelCallSettings, ResumableData, Sampled, eval_max_new_tokens, evaluate_items
from environments.evaluation import EvalSettings
from environments.verifiers_runner import compat
from environments.verifiers_runner.trajectory import (
    TrajectoryError,
    build_sequence,
    scored_group,
    turn_from_tokens,
)

log = logging.getLogger("environments.verifiers")

REQUEST_RETRIES = 5


# An eval sample passes at this reward: "correct" for the 0/1 rubrics most verifiers environments have.
PASS_REWARD = 0.5


class VerifiersEnvConfig(BaseEnvConfig, EvalSettings, ModelCallSettings):
    vf_env: str = Field(
        "",
        description="the verifiers environment: an installed environment id (as vf.load_environment resolves it) "
        "or a path to a .py file that defines load_environment",
    )
    vf_env_args: str = Field("{}", description="JSON object of keyword arguments for load_environment")
    temperature: float = Field(1.0, description="sampling temperature")
    max_new_tokens: int = Field(256, description="completion token limit of each model call")
    seed: int = Field(0, description="order of the environment's dataset")


def env_args(cfg: VerifiersEnvConfig) -> dict[str, Any]:
    try:
        args = json.loads(cfg.vf_env_args)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--env.vf_env_args={cfg.vf_env_args!r} is not JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise ValueError(f"--env.vf_env_args must be a JSON object, got {cfg.vf_env_args!r}")
    return args


def load_environment(name: str, args: dict[str, Any], tokenizer_name: str | None) -> vf.Environment:
    """A .py path is imported as a file and its load_environment called; anything else goes to
    vf.load_environment (an installed environment package). A load_environment that declares `tokenizer_name` gets
    the run's tokenizer folder unless args set it."""
    if not name:
        raise ValueError("no verifiers environment named: pass --env.vf_env=<id or file.py>")
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"verifiers environment file {name!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"vf_env_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        loader = getattr(module, "load_environment", None)
        if loader is None:
            raise ValueError(f"{name} defines no load_environment(...)")
    else:
        loader = None
    params = inspect.signature(loader).parameters if loader else {}
    if loader is not None and "tokenizer_name" in params and "tokenizer_name" not in args and tokenizer_name:
        args = {**args, "tokenizer_name": tokenizer_name}
    env = loader(**args) if loader is not None else vf.load_environment(name, **args)
    if not isinstance(env, vf.Environment):
        raise ValueError(
            f"load_environment of {name!r} returned {type(env).__name__}, not a verifiers Environment"
        )
    return env


class VerifiersEnv(ResumableData):
    name = "verifiers"
    data_position = ("next_index",)
    env_config_cls = VerifiersEnvConfig  # type: ignore[assignment]

    async def setup(self) -> None:
        cfg: Any = self.config
        self.vf_env = load_environment(cfg.vf_env, env_args(cfg), cfg.tokenizer_name)
        dataset = self.vf_env.dataset
        self.rows: list[dict[str, Any]] = dataset.to_list() if dataset is not None else []
        if not self.rows and not self.evaluate_only:
            raise ValueError(f"verifiers environment {cfg.vf_env!r} has no training rows")
        random.Random(cfg.seed).shuffle(self.rows)
        server = self.server.servers[0].config
        openai = AsyncOpenAI(
            base_url=server.base_url,
            api_key=server.api_key or "local",
            timeout=cfg.request_timeout_s,
            max_retries=REQUEST_RETRIES,
        )
        self.model = server.model_name
        token_in = await self.token_in(openai)
        self.client = compat.make_client(self.vf_env, openai, token_in)
        self.next_index = 0

    async def token_in(self, openai: AsyncOpenAI) -> bool:
        """Later turns go token-in when the environment can (compat.wants_token_in) and the gateway serves
        /tokenize (the Tinker sampler does not): then every turn of a rollout is trained, not only the last."""
        cfg: Any = self.config
        why_not = compat.wants_token_in(self.vf_env)
        if why_not is None:
            root = str(openai.base_url).rstrip("/").removesuffix("/v1")
            try:
                await openai.with_options(base_url=root).post(
                    "/tokenize", body={"model": self.model, "prompt": "a"}, cast_to=object
                )
            except APIStatusError as exc:
                why_not = f"the gateway does not serve /tokenize ({exc.status_code}: {exc.message})"
        if why_not is None:
            log.info("verifiers environment %r: turns after the first are sent as token ids", cfg.vf_env)
            return True
        log.info("verifiers environment %r: every turn is sent as messages (%s)", cfg.vf_env, why_not)
        return False

    async def get_next_item(self) -> dict[str, Any]:
        row = self.rows[self.next_index % len(self.rows)]
        self.next_index += 1
        return row

    def sampling_args(self, temperature: float, max_tokens: int) -> dict[str, Any]:
        """The environment's own sampling args (stop strings, ...) with the run's temperature and length, one
        completion per call, and what makes the answer carry the sampled ids and their logprobs."""
        args = deepcopy(self.vf_env.sampling_args)
        extra = {**(args.pop("extra_body", None) or {}), "return_token_ids": True}
        args.update(n=1, temperature=temperature, max_tokens=max_tokens, logprobs=True, extra_body=extra)
        return args

    async def run_group(
        self, item: dict[str, Any], n: int, temperature: float, max_tokens: int
    ) -> list[Mapping[str, Any]]:
        """n rollouts of one dataset row, scored by the environment's rubric (verifiers' own group path)."""
        rows = [deepcopy(item) for _ in range(n)]
        args = self.sampling_args(temperature, max_tokens)
        return await compat.run_group(self.vf_env, self.client, rows, self.model, args)

    async def collect_trajectories(self, item: dict[str, Any]) -> tuple[ScoredDataGroup | None, list[Any]]:
        cfg: Any = self.config
        states = await self.run_group(item, cfg.group_size, cfg.temperature, cfg.max_new_tokens)
        failed = [s["error"] for s in states if s.get("error") is not None]
        if failed:
            log.warning(
                "group of example %s dropped: a rollout failed: %r", item.get("example_id"), failed[0]
            )
            return None, []
        try:
            built = [
                build_sequence(
                    [
                        turn_from_tokens(step.get("tokens"), f"example {item.get('example_id')} turn {t}")
                        for t, step in enumerate(s["trajectory"])
                    ]
                )
                for s in states
            ]
            group = scored_group(built, [s["reward"] for s in states])
        except TrajectoryError as exc:
            log.error("group of example %s dropped: %s", item.get("example_id"), exc)
            return None, []
        untrained = sum(b.untrained_turns for b in built)
        if untrained:
            log.info(
                "example %s: %d earlier turns not trained (a later prompt re-rendered them into other ids)",
                item.get("example_id"),
                untrained,
            )
        return ScoredDataGroup(**group), []  # type: ignore[typeddict-item]

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The environment's eval dataset, eval_k rollouts per row scored by its rubric; a sample passes at reward
        >= PASS_REWARD. An environment without an eval dataset reports nothing."""
        cfg: Any = self.config
        if self.vf_env.eval_dataset is None:
            log.warning("verifiers environment %r has no eval dataset: nothing to evaluate", cfg.vf_env)
            return
        rows = self.vf_env.eval_dataset.to_list()
        await evaluate_items(self, rows, self.eval_samples, PASS_REWARD, cfg.wandb_name)

    async def eval_samples(self, row: dict[str, Any]) -> list[Sampled]:
        cfg: Any = self.config
        states = await self.run_group(row, cfg.eval_k, cfg.eval_temperature, eval_max_new_tokens(cfg))
        failed = next((s["error"] for s in states if s.get("error") is not None), None)
        if failed is not None:
            raise RuntimeError(f"a rollout of eval example {row.get('example_id')} failed: {failed!r}")
        return [(float(s["reward"]), {"prompt": s["prompt"], "completion": s["completion"]}) for s in states]
