"""Pre-flight of an Atropos environment file (`python -m environments.upstream FILE preflight ...`): what will
not work, found in seconds by running the environment's own code, never by guessing from its source.

- flags the user set that its config class does not declare (an error), launcher flags it will not get (a note);
- the server configs it declares, which the gateway replaces (a note);
- its setup() (data, packages) and its first prompts, built against a recording stand-in server: a prompt that
  leaves no room for a completion under the run's limits is an error naming the limits and the lengths seen.

Prints `preflight: PROBLEM` lines on stderr and `note: ...` lines on stdout; exits 2 when there is a problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.common import env_flags
from environments.upstream.envfile import (
    EnvFileError,
    default_config,
    describe_servers,
    drop_refused,
    load_env_class,
    split_flags,
)

PROBE_ITEMS = 3
PROBE_BUDGET_S = 120.0
ITEM_WAIT_S = 15.0


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def emit(self) -> int:
        for note in self.notes:
            print(f"note: {' '.join(note.split())}", flush=True)
        for problem in self.problems:  # one line each: the launcher reads them line by line
            print(f"preflight: {' '.join(problem.split())}", file=sys.stderr, flush=True)
        return 2 if self.problems else 0


@dataclass
class Limits:
    """The run's limits a prompt must leave room under, by the config key a user would raise."""

    by_key: dict[str, int]

    def tightest(self) -> tuple[str, int]:
        return min(self.by_key.items(), key=lambda kv: kv[1])


@dataclass
class Seen:
    prompt_tokens: list[int] = field(default_factory=list)
    requests: int = 0


def prompt_length(tokenizer: Any, prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, dict):  # vLLM's {"prompt_token_ids": [...]}
        return len(prompt.get("prompt_token_ids") or [])
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return 0


def record_chat_prompts(tokenizer: Any, seen: Seen) -> None:
    """Every chat the environment renders is a prompt it is about to send (or to skip for being too long, which an
    environment may do without a word): the stand-in server never returns a completion to render after."""
    original = tokenizer.apply_chat_template

    def apply_chat_template(conversation: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(conversation, *args, **kwargs)
        with contextlib.suppress(Exception):
            seen.prompt_tokens.append(prompt_length(tokenizer, result))
        return result

    tokenizer.apply_chat_template = apply_chat_template


async def stand_in_server(tokenizer: Any, seen: Seen) -> tuple[Any, str]:
    """A local HTTP server that records each generation request's prompt and answers 503, so the environment's
    client backs off while the probe reads what it sent."""
    from aiohttp import web

    async def health(_: Any) -> Any:
        return web.json_response({"status": "ok"})

    async def generation(request: Any) -> Any:
        with contextlib.suppress(Exception):
            body = await request.json()
            seen.requests += 1
            if "messages" in body:
                rendered = tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True, tokenize=False
                )
                seen.prompt_tokens.append(prompt_length(tokenizer, rendered))
            else:
                seen.prompt_tokens.append(prompt_length(tokenizer, body.get("prompt")))
        return web.json_response({"error": "pre-flight probe: no sampling"}, status=503)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", health)
    app.router.add_route("POST", "/{tail:.*}", generation)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"


async def probe_prompts(cls: type[Any], config: Any, report: Report, budget_s: float) -> Seen:
    """Run setup() and up to PROBE_ITEMS items' collect_trajectories against the stand-in server: the prompt
    lengths seen, in tokens, and how many requests reached it."""
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from transformers import AutoTokenizer

    seen = Seen()
    deadline = time.monotonic() + budget_s
    # A tokenizer of its own: the environment's records every render it makes (record_chat_prompts).
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name)
    runner, url = await stand_in_server(tokenizer, seen)
    try:
        server = APIServerConfig(
            base_url=url,
            model_name=config.tokenizer_name,
            tokenizer_name=config.tokenizer_name,
            api_key="probe",
            server_type="vllm",
            health_check=False,
            timeout=5,
        )
        env = cls(config=config, server_configs=[server], slurm=False, testing=False)
        record_chat_prompts(env.tokenizer, seen)
        try:
            await asyncio.wait_for(env.setup(), timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            report.notes.append(f"setup() did not finish within {budget_s:.0f} s: prompt lengths not checked")
            return seen
        except Exception as exc:
            report.problems.append(setup_failure(cls, exc))
            return seen
        for _ in range(PROBE_ITEMS):
            if time.monotonic() > deadline:
                break
            before = (len(seen.prompt_tokens), seen.requests)
            try:
                item = await asyncio.wait_for(env.get_next_item(), timeout=ITEM_WAIT_S)
            except Exception as exc:
                report.problems.append(f"{cls.__name__}.get_next_item() failed: {type(exc).__name__}: {exc}")
                break
            if item is None:
                break
            task = asyncio.ensure_future(env.collect_trajectories(item))
            until = min(deadline, time.monotonic() + ITEM_WAIT_S)
            while not task.done() and (len(seen.prompt_tokens), seen.requests) == before:
                if time.monotonic() > until:
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        return seen
    finally:
        await runner.cleanup()


def setup_failure(cls: type[Any], exc: Exception) -> str:
    text = f"{cls.__name__}.setup() failed: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
    offline = any(
        s in str(exc).lower() for s in ("offline", "couldn't reach", "connection", "resolve", "network")
    )
    if offline or isinstance(exc, ConnectionError):
        named = re.search(r"reach '([^']+)'", str(exc))
        name = named.group(1) if named else "NAME"
        text += (
            ". Its data could not be fetched: download it where there is network (e.g. "
            f"`python -c \"from datasets import load_dataset; load_dataset('{name}')\"` with the config and "
            "split the environment asks for), copy the Hugging Face cache (~/.cache/huggingface) here, and run "
            "with HF_DATASETS_OFFLINE=1"
        )
    return text


ENV_LIMIT = "rollout.max_token_length"


def check_prompts(seen: Seen, limits: Limits, report: Report) -> None:
    """A prompt at or past the trainer's or vLLM's limit leaves no trained token; one past the environment's own
    max_token_length is fatal only where the environment then skips the item (no request reached the stand-in):
    others use the value as a completion budget and send the prompt anyway."""
    lengths = seen.prompt_tokens
    if not lengths:
        report.notes.append("no prompt was seen while probing the first items: prompt lengths not checked")
        return
    longest = max(lengths)
    binding = {k: v for k, v in limits.by_key.items() if k != ENV_LIMIT or not seen.requests}
    over = {k: v for k, v in binding.items() if longest >= v}
    if over:
        key, limit = min(over.items(), key=lambda kv: kv[1])
        others = ", ".join(f"{k}={v}" for k, v in limits.by_key.items())
        skipped = " and the environment sent no request for them" if key == ENV_LIMIT else ""
        report.problems.append(
            f"the environment's prompts are up to {longest} tokens (measured on {len(lengths)} prompt(s) of its "
            f"first items){skipped}: {key}={limit} leaves no room for a completion (limits: {others}); every "
            f"item would be skipped or left without a trained token. Raise {', '.join(sorted(over))} above "
            f"{longest} plus the completion budget, or shorten the environment's prompt"
        )
        return
    key, limit = limits.tightest()
    report.notes.append(f"prompts measured: up to {longest} tokens; tightest limit {key}={limit}")
    if ENV_LIMIT in limits.by_key and longest >= limits.by_key[ENV_LIMIT]:
        report.notes.append(
            f"prompts are longer than {ENV_LIMIT}={limits.by_key[ENV_LIMIT]}, but the environment still sends "
            "them (it uses the value as a completion budget)"
        )


def preflight(path: Path, argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    report = Report()
    try:
        cls = load_env_class(path)
        env_config, servers = default_config(cls)
    except EnvFileError as exc:
        report.problems.append(str(exc))
        return report.emit()
    fields = set(type(env_config).model_fields)
    flags = split_flags(argv, fields)
    for key in flags.dropped:
        if key in flags.user_keys:
            report.problems.append(
                f"rollout.env_args.{key}: {cls.__name__}'s config class {type(env_config).__name__} has no "
                f"field {key!r}; remove it or use one of: {', '.join(sorted(fields))}"
            )
        else:
            report.notes.append(f"--env.{key} is not passed: {type(env_config).__name__} does not declare it")
    report.notes.append(
        f"{cls.__name__} declares {describe_servers(servers)}: launch.sh sends all its requests to the gateway"
    )
    report.notes += drop_refused(env_config, flags)
    values = {**env_config.model_dump(), **env_flags(flags.kept)}
    values.update(use_wandb=False, data_path_to_save_groups=None)
    try:
        config = type(env_config)(**values)
    except Exception as exc:
        report.problems.append(
            f"the --env.* flags do not validate against {type(env_config).__name__}: {exc}"
        )
        return report.emit()
    if report.problems:
        return report.emit()
    limits = Limits({"rollout.max_token_length": int(config.max_token_length)})
    for option, key in (
        ("max-seq-len", "trainer.max_seq_len"),
        ("max-model-len", "inference.vllm.max_model_len"),
    ):
        if flags.options.get(option):
            limits.by_key[key] = int(flags.options[option])
    seen = asyncio.run(probe_prompts(cls, config, report, PROBE_BUDGET_S))
    if not report.problems:
        check_prompts(seen, limits, report)
    return report.emit()
