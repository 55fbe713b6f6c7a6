"""A verifiers v1 environment (`verifiers.v1`, 0.2 and later: a taskset, an agent harness and a runtime) as an Atropos
environment process: atroposlib's BaseEnv registers with run-api, paces itself and posts the groups; verifiers runs
each group's episodes and scores them with the taskset's rewards. Runs in the v1 venv (launch.sh builds it when a
`vf:` file that imports verifiers.v1 is named); nothing else imports this module.

The exact tokens: the episodes' model calls go to verifiers' training client (TrainClientConfig), which renders each
prompt to ids with the run's tokenizer (the `renderers` package) and posts them to the gateway's token-in route
(`/inference/v1/generate`, inference/http/token_in_generate.py); the gateway samples them under the current policy and records
the answer in its version ledger. verifiers keeps the ids, mask and logprobs on the trace's message graph, which
environments.verifiers_v1_runner.trajectory turns into the sequences run-api receives.

Every agent role runs in verifiers' local `subprocess` runtime (its default is Prime's hosted sandboxes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from atroposlib.envs.base import BaseEnvConfig, ScoredDataGroup
from pydantic import Field
from verifiers.v1.configs.client import ClientTimeoutConfig

from environments.common import ModelCallSettings, ResumableData, Sampled, eval_max_new_tokens, evaluate_items
from environments.evaluation import EvalSettings
from environments.verifiers_runner.trajectory import Built, TrajectoryError, scored_group
from environments.verifiers_v1_runner.trajectory import NodeTokens, build_branch

log = logging.getLogger("environments.verifiers_v1")
# The env_args key that picks the agents' harness by id (else the taskset's own harness, or verifiers' bash).
HARNESS_ARG = "harness"
# An eval sample passes at this reward: "correct" for the 0/1 rewards most tasksets have (as for v0).
PASS_REWARD = 0.5


class VerifiersV1EnvConfig(BaseEnvConfig, EvalSettings, ModelCallSettings):
    vf_env: str = Field(
        "",
        description="the verifiers v1 taskset: a path to a .py module that defines it (its stem is the taskset id) "
        "or an installed taskset id",
    )
    vf_env_args: str = Field(
        "{}", description="JSON object: the taskset config's keys (and 'harness': an id)"
    )
    temperature: float = Field(1.0, description="sampling temperature")
    max_new_tokens: int = Field(256, description="completion token limit of each model call")
    seed: int = Field(0, description="order of the taskset's tasks")


def env_args(raw: str) -> dict[str, Any]:
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--env.vf_env_args={raw!r} is not JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise ValueError(f"--env.vf_env_args must be a JSON object, got {raw!r}")
    return args


def taskset_id(name: str) -> str:
    """The taskset id verifiers imports: a file's stem (its folder goes on the import path), else `name` itself."""
    if not name:
        raise ValueError("no verifiers v1 taskset named: pass --env.vf_env=<file.py or id>")
    if not name.endswith(".py"):
        return name
    path = Path(name).resolve()
    if not path.is_file():
        raise ValueError(f"verifiers v1 taskset file {name!r} does not exist")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return path.stem


def load_env(name: str, args: dict[str, Any], tokenizer_name: str | None) -> vf.Env:
    """The environment for taskset `name` with `args` as its taskset config (a config that declares
    `tokenizer_name` gets the run's tokenizer folder unless args set it), every agent role on the local subprocess
    runtime, and args' `harness` (an id) as every role's harness when given."""
    ident = taskset_id(name)
    args = dict(args)
    harness = args.pop(HARNESS_ARG, None)
    if harness is not None and not isinstance(harness, str):
        raise ValueError(f"rollout.env_args.{HARNESS_ARG}: a harness id, got {harness!r}")
    if "tokenizer_name" in vf.taskset_config_type(ident).model_fields and tokenizer_name:
        args.setdefault("tokenizer_name", tokenizer_name)
    config_cls = vf.env_config_type(ident)
    roles = [n for n, f in config_cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)]
    role: dict[str, Any] = {"runtime": {"type": "subprocess"}}
    if harness is not None:
        role["harness"] = {"id": harness}
    config = config_cls.model_validate({"taskset": {**args, "id": ident}, **{r: role for r in roles}})
    env: vf.Env = vf.environment_class(ident)(config)
    return env


def node_tokens(node: Any) -> NodeTokens:
    return NodeTokens(token_ids=list(node.token_ids), mask=list(node.mask), logprobs=list(node.logprobs))


def built_episodes(episodes: Sequence[Any], where: str) -> tuple[list[Built], list[float]]:
    """Every trainable branch of every trainable trace, each scored with its trace's reward. A failed episode
    (verifiers' `ok` false: a harness, model call or reward that raised) fails the whole group."""
    built: list[Built] = []
    scores: list[float] = []
    for e, episode in enumerate(episodes):
        if not episode.ok:
            first = episode.errors[0].message if episode.errors else "no error recorded"
            errors = [x.message for t in episode.traces for x in t.errors]
            raise TrajectoryError(f"{where}: episode {e} failed: {first}{'; ' + errors[0] if errors else ''}")
        for t, trace in enumerate(episode.traces):
            if not trace.agent.trainable:
                continue
            for branch in trace.branches:
                if branch.trainable:
                    nodes = [node_tokens(n) for n in branch.nodes]
                    built.append(build_branch(nodes, f"{where} episode {e} trace {t} branch {branch.index}"))
                    scores.append(float(trace.reward))
    return built, scores


class VerifiersV1Env(ResumableData):
    name = "verifiers_v1"
    data_position = ("next_index",)
    env_config_cls = VerifiersV1EnvConfig  # type: ignore[assignment]

    async def setup(self) -> None:
        cfg: Any = self.config
        # verifiers logs two lines per rollout at INFO; the environment's log keeps its warnings.
        logging.getLogger("verifiers").setLevel(logging.WARNING)
        self.vf_env = load_env(cfg.vf_env, env_args(cfg.vf_env_args), cfg.tokenizer_name)
        self.tasks: list[Any] = list(self.vf_env.taskset)
        if not self.tasks:
            raise ValueError(f"verifiers v1 taskset {cfg.vf_env!r} has no tasks")
        random.Random(cfg.seed).shuffle(self.tasks)
        server = self.server.servers[0].config
        # verifiers reads the key from this variable (which also keeps it off Prime's defaults); the launcher's key
        # is no secret (loopback) but names this environment to the gateway's on-policy gate.
        os.environ["GATEWAY_API_KEY"] = server.api_key or "local"
        self.ctx = vf.ModelContext(
            model=server.model_name,
            client=vf.TrainClientConfig(
                base_url=server.base_url,
                api_key_var="GATEWAY_API_KEY",
                renderer_model_name=cfg.tokenizer_name,
                # Between bytes: the gateway sends nothing while the gate holds the request or vLLM restarts.
                timeout=ClientTimeoutConfig(read=cfg.request_timeout_s),
            ),
            sampling=vf.SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens),
        )
        # The interception server and shared tools live as long as the process.
        self.serving = contextlib.AsyncExitStack()
        await self.serving.enter_async_context(self.vf_env.serving())
        self.next_index = 0

    async def get_next_item(self) -> Any:
        task = self.tasks[self.next_index % len(self.tasks)]
        self.next_index += 1
        return task

    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list[Any]]:
        cfg: Any = self.config
        slots = self.vf_env.slots(item, cfg.group_size)
        episodes = await asyncio.gather(*(self.vf_env.run_slot(s, self.ctx) for s in slots))
        try:
            built, scores = built_episodes(episodes, f"task {item.data.idx}")
            group = scored_group(built, scores)
        except TrajectoryError as exc:
            log.error("group dropped: %s", exc)
            return None, []
        return ScoredDataGroup(**group), []  # type: ignore[typeddict-item]

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The taskset's tasks (v1 has no eval split: the same tasks, as verifiers' own eval runs a taskset), eval_k
        episodes each through the evaluation target's token-in route (the run's base URL is /eval/<target>/v1 here),
        scored by the taskset's rewards; a sample passes at reward >= PASS_REWARD."""
        cfg: Any = self.config
        await evaluate_items(self, self.tasks, self.eval_samples, PASS_REWARD, cfg.wandb_name)

    async def eval_samples(self, task: Any) -> list[Sampled]:
        cfg: Any = self.config
        sampling = vf.SamplingConfig(temperature=cfg.eval_temperature, max_tokens=eval_max_new_tokens(cfg))
        ctx = dataclasses.replace(self.ctx, sampling=sampling)
        slots = self.vf_env.slots(task, cfg.eval_k)
        episodes = await asyncio.gather(*(self.vf_env.run_slot(s, ctx) for s in slots))
        failed = next((e for e in episodes if not e.ok), None)
        if failed is not None:
            why = failed.errors[0].message if failed.errors else "no error recorded"
            raise RuntimeError(f"an episode of eval task {task.data.idx} failed: {why}")
        return [
            (float(t.reward), {"prompt": task.data.prompt, "completion": t.last_reply})
            for e in episodes
            for t in e.traces
            if t.agent.trainable
        ]
