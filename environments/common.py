"""Pieces every built-in environment shares: the gateway server config, the scored group built from
ManagedServer nodes, and the process entry point. Imports atroposlib; nothing here talks to the trainer."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from atroposlib.envs.base import APIServerConfig, BaseEnv, ScoredDataGroup


def gateway_servers() -> list[APIServerConfig]:
    """One gateway server, as a list: atroposlib rewrites a bare APIServerConfig to localhost:9004-9007.
    launch.sh overrides the URL and model with --openai.* flags."""
    return [
        APIServerConfig(
            model_name="policy", base_url="http://127.0.0.1:9000/v1", api_key="local", server_type="vllm"
        )
    ]


def completion_ids(node: Any) -> list[int]:
    return [t for t in node.masked_tokens if t != -100]


def group_from_nodes(nodes: Sequence[Any], scores: Sequence[float]) -> ScoredDataGroup:
    """The group run-api receives: ManagedServer's tokens, -100 prompt masks and aligned sampler logprobs."""
    group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
    for node, score in zip(nodes, scores, strict=True):
        group["tokens"].append(node.tokens)
        group["masks"].append(node.masked_tokens)
        group["inference_logprobs"].append(node.logprobs)
        group["scores"].append(float(score))
    return group


class ResumableData(BaseEnv):
    """Keeps an environment's place in its data across restarts, through Atropos's own env checkpoints: saved
    with each trainer checkpoint interval, and loaded by a (re)started environment from the newest one at or
    before the step run-api registers it at (Atropos itself loads only an exact step match, and names the folder
    after the registration count, which changes when an environment is restarted)."""

    data_position: tuple[str, ...] = ()  # attributes that hold the place, e.g. ("index",)

    def _position_folder(self) -> Path:
        return Path(self.checkpoint_dir) / "env_checkpoints" / str(self.config.wandb_name)

    def save_checkpoint(self, step: int, data: dict[str, Any] | None = None) -> None:
        position = {**(data or {}), **{key: getattr(self, key) for key in self.data_position}}
        folder = self._position_folder()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".step-{step}.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(position))
        tmp.replace(folder / f"step-{step}.json")

    def load_checkpoint(self) -> None:
        saved = []
        for path in self._position_folder().glob("step-*.json"):
            match = re.fullmatch(r"step-(\d+)\.json", path.name)
            if match and int(match.group(1)) <= self.curr_step:
                saved.append((int(match.group(1)), path))
        if not saved:
            return
        step, path = max(saved)
        for key, value in json.loads(path.read_text()).items():
            setattr(self, key, value)
        logging.getLogger(__name__).info("resumed the data position of step %d: %s", step, path.read_text())


Preflight = Callable[[dict[str, str]], list[str]]


def hub_reachable(timeout_s: float = 5.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        httpx.head(
            os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=timeout_s, follow_redirects=True
        )
        return True
    except httpx.HTTPError:
        return False


def env_flags(argv: Sequence[str]) -> dict[str, str]:
    """`--env.key=value` flags as {key: value} (the launcher passes rollout.env_args this way)."""
    flags = {}
    for arg in argv:
        key, sep, value = arg.removeprefix("--").partition("=")
        if sep and key.startswith("env."):
            flags[key.removeprefix("env.")] = value
    return flags


def run_preflight(check: Preflight | None, argv: Sequence[str]) -> int:
    """`python -m environments.NAME preflight [--env.key=value ...]`: one `preflight: ...` line on stderr per
    problem (what is missing and how to supply it), exit 2 if any."""
    problems = check(env_flags(argv)) if check else []
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    return 2 if problems else 0


def configure_logging() -> None:
    # atroposlib logs at INFO without a handler of its own.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def chat_template_returns_ids() -> None:
    """transformers 5 made `apply_chat_template(..., tokenize=True)` return a BatchEncoding unless the caller
    passes return_dict=False; atroposlib 0.4.0 (tokenize_for_trainer, ~50 upstream environments) was written for
    transformers 4, where it returned the token ids, and its groups then fail to serialise. In an environment
    process only, restore the old default: a caller that names return_dict (or asks for the assistant mask, which
    needs the dict) is left alone."""
    from transformers import PreTrainedTokenizerBase

    original = PreTrainedTokenizerBase.apply_chat_template
    if getattr(original, "_returns_ids", False):
        return

    def apply_chat_template(self: Any, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        if "return_dict" not in kwargs and not kwargs.get("return_assistant_tokens_mask"):
            kwargs["return_dict"] = False
        return original(self, conversation, *args, **kwargs)

    apply_chat_template._returns_ids = True  # type: ignore[attr-defined]
    PreTrainedTokenizerBase.apply_chat_template = apply_chat_template  # type: ignore[method-assign]


def run_cli(env_cls: type[BaseEnv], preflight: Preflight | None = None) -> None:
    if sys.argv[1:2] == ["preflight"]:
        sys.exit(run_preflight(preflight, sys.argv[2:]))
    configure_logging()
    chat_template_returns_ids()
    env_cls.cli()
