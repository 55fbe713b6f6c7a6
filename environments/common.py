"""Pieces every built-in environment shares: the gateway server config, the scored group built from
ManagedServer nodes, and the process entry point. Imports atroposlib; nothing here talks to the trainer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, ScoredDataGroup


def gateway_servers() -> list[APIServerConfig]:
    """One gateway server, as a list: atroposlib rewrites a bare APIServerConfig to localhost:9004-9007.
    launch.sh overrides the URL and model with --openai.* flags."""
    return [APIServerConfig(model_name="policy", base_url="http://127.0.0.1:9000/v1", api_key="local",
                            server_type="vllm")]


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


def run_cli(env_cls: type[BaseEnv]) -> None:
    # atroposlib logs at INFO without a handler of its own.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    env_cls.cli()
