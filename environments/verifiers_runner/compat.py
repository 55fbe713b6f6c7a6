"""What differs between the verifiers v0 releases the runner drives: how a group is run and how token-in later
turns are switched on. Runs in the verifiers venv; env.py calls only this module for either.

- 0.1.9.post2: `Environment.run_group(inputs, AsyncOpenAI, model, sampling_args, gen_sem, score_sem)` returns the
  rollouts' states; token-in later turns are the environment's `interleaved_rollouts` flag.
- 0.1.14: `run_group(inputs, client, model, sampling_args, max_retries, state_columns)` takes verifiers' own `Client`
  (a wrapper of the AsyncOpenAI client: chat, completions, or the chat client whose later turns go to
  `/v1/chat/completions/tokens`) and returns serialised outputs, which carry the per-turn token record only when
  `trajectory` is named in state_columns.

Either way a group comes back as one mapping per rollout with `reward`, `trajectory` (each step's `tokens`),
`prompt`, `completion` and, for a failed rollout, `error`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any, Literal

import verifiers as vf
from openai import AsyncOpenAI

Api = Literal["states", "outputs"]


def run_group_api(env: Any) -> Api:
    """'states' for the 0.1.9 signature (semaphores), 'outputs' for the 0.1.14 one (state_columns)."""
    params = inspect.signature(type(env).run_group).parameters
    if "gen_sem" in params:
        return "states"
    if "state_columns" in params:
        return "outputs"
    raise RuntimeError(
        f"verifiers {vf.__version__}: Environment.run_group takes {list(params)}, neither the 0.1.9 nor the 0.1.14 "
        "signature the runner knows; install the version environments/verifiers_runner/requirements.txt pins"
    )


def tools_of(env: Any) -> list[Any]:
    """The tools the environment offers the model (0.1.9: oai_tools; 0.1.14: tool_defs as well)."""
    return list(getattr(env, "oai_tools", None) or getattr(env, "tool_defs", None) or [])


def wants_token_in(env: Any) -> str | None:
    """Why later turns cannot go token-in for this environment, or None when they can: a chat environment that
    offers no tools (the token route parses no tool calls) and makes more than one model call."""
    if getattr(env, "message_type", "chat") != "chat":
        return "a completion environment"
    if tools_of(env):
        return "it offers tools, and the token-in route parses no tool calls"
    if isinstance(env, vf.SingleTurnEnv) or getattr(env, "max_turns", 0) == 1:
        return "one model call per rollout"
    return None


def make_client(env: Any, openai: AsyncOpenAI, token_in: bool) -> Any:
    """What run_group takes as its client: the AsyncOpenAI client itself for 0.1.9 (token-in switched on the
    environment), verifiers' Client wrapping it for 0.1.14."""
    if run_group_api(env) == "states":
        env.set_interleaved_rollouts(token_in)
        return openai
    from verifiers.clients import (
        OpenAIChatCompletionsClient,
        OpenAIChatCompletionsTokenClient,
        OpenAICompletionsClient,
    )

    if getattr(env, "message_type", "chat") == "completion":
        return OpenAICompletionsClient(openai)
    return (OpenAIChatCompletionsTokenClient if token_in else OpenAIChatCompletionsClient)(openai)


async def run_group(
    env: Any, client: Any, rows: list[dict[str, Any]], model: str, sampling_args: dict[str, Any]
) -> list[Mapping[str, Any]]:
    """The rollouts of `rows` (one group), scored by the environment's rubric."""
    if run_group_api(env) == "states":
        n = len(rows)
        states = await env.run_group(
            rows, client, model, sampling_args, asyncio.Semaphore(n), asyncio.Semaphore(n)
        )
        return list(states)
    outputs = await env.run_group(rows, client, model, sampling_args, state_columns=["trajectory"])
    return list(outputs)
