"""A gateway app over a scripted sampler (no vLLM): what the gateway unit tests and the in-process servers of
the integration tests drive."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from inference.app import create_app
from inference.config import GatewayConfig
from inference.policy.adapters import check_path, read_config
from inference.policy.registry import Policy, PolicyRegistry
from inference.samplers.vllm import (
    BackendError,
)
from inference.wire import Sample, SamplingRequest


class ScriptedBackend:
    """Answers from a script; records which model name each request used. `gate` holds samples until set."""

    url = "http://scripted"
    pid = None

    def __init__(self) -> None:
        self.state = "ready"
        self.restarts = 0
        self.max_model_len: int | None = 64
        self.loaded: list[str] = []
        self.unloaded: list[str] = []
        self.gate: asyncio.Event | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        if self.gate is not None:
            await self.gate.wait()
        return [
            Sample(
                token_ids=[policy.version, i],
                logprobs=[-0.1, -0.2],
                finish_reason="length" if req.max_tokens <= 2 else "stop",
            )
            for i in range(req.n)
        ]

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        return {
            "choices": [{"index": 0, "text": "x", "token_ids": [9], "prompt_token_ids": [1, 2]}],
            "model": policy.model_name,
        }

    def validate_adapter(self, path: str) -> None:
        read_config(check_path(path), 8)  # the tensors of these fake adapters are not real

    async def load_adapter(self, policy: Policy) -> None:
        if "bad" in str(policy.adapter_path):
            raise BackendError(400, "vLLM rejected the request: bad adapter")
        self.loaded.append(policy.model_name)

    async def unload_adapter(self, policy: Policy) -> None:
        self.unloaded.append(policy.model_name)


def make_adapter(root: Path, name: str, rank: int = 8) -> str:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank}))
    (folder / "adapter_model.safetensors").write_bytes(b"x")
    return str(folder)


def client_for(backend: ScriptedBackend, **cfg: Any) -> tuple[httpx.AsyncClient, PolicyRegistry]:
    gcfg = GatewayConfig(model="m", vllm={"max_lora_rank": 8}, **cfg)
    reg = PolicyRegistry("base", gcfg.keep_versions)
    app = create_app(gcfg, backend, reg, vocab_size=100, start_backend=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"), reg


def publish_body(version: int, path: str | None, replace_newer: bool = False) -> dict[str, Any]:
    return {"version": version, "adapter_path": path, "replace_newer": replace_newer}
