"""A plain chat harness that runs in the runner's own process: offline, where verifiers' built-in chat harness
(`null`) is not.

verifiers 0.4's `null` harness (and every harness built on its chat program) prepares its program with
`uv sync --script` in each rollout's runtime, with UV_OFFLINE forced off: without a package registry every rollout
fails in setup ("failed to prepare uv script"), and with one, each rollout spends a uv resolve and a Python start.
verifiers' Harness contract allows a loop in-process, as long as every model call goes through the rollout's
interception endpoint: this one sends the task's prompt (its system prompt first) as one chat completion and ends
at the reply, as `null` does for a reply without tool calls. No tools are offered; a task that needs them needs a
harness that runs them.

A taskset module selects it by exporting it beside its Taskset (`__all__`): verifiers then takes it as the
taskset's bundled harness (tests/envs/vf1_toy.py does).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from verifiers.v1.dialects.chat import message_to_wire

from rlcommon.timeouts import CLIENT_SLACK_S, model_call_timeout_s

# One HTTP client per event loop for every episode's OpenAI client: a new httpx client builds an SSL context, loading
# the CA bundle: 45% of the runner's CPU samples at 64 episodes a step (py-spy), and the trainer's wait for a batch
# went from 3.3 to 2.2 s a step on the 2-core box without it. An httpx client belongs to the loop it runs on.
_HTTP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DefaultAsyncHttpxClient] = (
    weakref.WeakKeyDictionary()
)


def shared_http() -> DefaultAsyncHttpxClient:
    loop = asyncio.get_running_loop()
    client = _HTTP.get(loop)
    if client is None or client.is_closed:
        client = _HTTP[loop] = DefaultAsyncHttpxClient()
    return client


class ChatHarnessConfig(vf.HarnessConfig):
    """No knobs: the sampling parameters are the run's (the runner's model context)."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # verifiers' default resume relaunches it on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        # The interception server answers once the run's client has the gateway's answer: wait that long, and more.
        timeout = (ctx.client.timeout.read or model_call_timeout_s()) + CLIENT_SLACK_S
        # Not closed after the call: closing it would close the shared HTTP client.
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, timeout=timeout, http_client=shared_http())
        # The interception server records the call on `trace` (tokens included) and answers it.
        await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness"]
