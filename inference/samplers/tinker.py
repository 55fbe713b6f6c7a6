"""The Tinker sampling backend: the gateway's routes served from Tinker SamplingClients instead of a local vLLM.

One SamplingClient per published policy (its `tinker://.../sampler_weights/...` path), one for the base model.
OpenAI routes are translated here (tokenize, sample, detokenize) since Tinker samples token ids only.
`tinker` is imported only when this backend is built.
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from inference.config import GatewayConfig, GatewayConfigError, TinkerSamplerConfig
from inference.errors import BackendError
from inference.policy.registry import Policy
from inference.wire import Sample, SamplingRequest

SUPPORTED_KEYS = frozenset({"temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed"})


def build_sampling_params(tinker: Any, max_tokens: int, sampling: dict[str, Any]) -> Any:
    unsupported = sorted(set(sampling) - SUPPORTED_KEYS)
    if unsupported:
        raise BackendError(
            400,
            f"sampling parameter(s) {unsupported} are not supported by the Tinker sampler; "
            f"supported: {sorted(SUPPORTED_KEYS)}",
        )
    stop, stop_ids = sampling.get("stop"), sampling.get("stop_token_ids")
    if stop and stop_ids:
        raise BackendError(400, "the Tinker sampler takes stop strings or stop_token_ids, not both")
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    for key in ("temperature", "top_p", "top_k", "seed"):
        if sampling.get(key) is not None:
            kwargs[key] = sampling[key]
    if stop:
        kwargs["stop"] = [stop] if isinstance(stop, str) else list(stop)
    elif stop_ids:
        kwargs["stop"] = [int(t) for t in stop_ids]
    return tinker.SamplingParams(**kwargs)


def service_factory(cfg: TinkerSamplerConfig) -> Callable[[], Any]:
    """What makes the ServiceClient: `client_factory` ('module:function', for proxies and tests) or tinker's own,
    which reads TINKER_API_KEY (launch.sh checked it before starting anything)."""
    if cfg.client_factory:
        module, _, attr = cfg.client_factory.partition(":")
        if not attr:
            raise GatewayConfigError(
                f"inference.tinker.client_factory={cfg.client_factory!r} must look like "
                "'package.module:function'"
            )
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
    return lambda: importlib.import_module("tinker").ServiceClient()


class TinkerSamplingBackend:
    url = "tinker"

    def __init__(
        self,
        cfg: GatewayConfig,
        base_model: str,
        tokenizer: Any,
        service_factory: Callable[[], Any],
        timeout_s: float,
    ):
        self.cfg = cfg
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.service_factory = service_factory
        self.timeout_s = timeout_s
        self.state = "stopped"
        self.restarts = 0
        self.max_model_len: int | None = cfg.vllm.max_model_len
        self._service: Any = None
        self._clients: dict[str, Any] = {}
        import tinker

        self._tinker = tinker

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def pid(self) -> int | None:
        return None

    async def _resolve(self, future: Any, what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(future.result), timeout=self.timeout_s)
        except TimeoutError as exc:
            raise BackendError(503, f"Tinker did not answer {what} within {self.timeout_s:.0f}s") from exc

    async def start(self) -> None:
        self.state = "starting"
        try:
            self._service = await asyncio.to_thread(self.service_factory)
            client = await self._resolve(
                self._service.create_sampling_client(base_model=self.base_model),
                "the base-model sampling client",
            )
        except Exception:
            self.state = "failed"
            raise
        self._clients[self.cfg.served_model_name] = client
        self.state = "ready"

    async def stop(self) -> None:
        self.state = "stopped"
        self._clients.clear()

    def validate_adapter(self, path: str) -> None:
        if not path.startswith("tinker://"):
            raise BackendError(400, f"adapter_path {path!r} is not a Tinker sampler path (tinker://...)")

    async def load_adapter(self, policy: Policy) -> None:
        client = await self._resolve(
            self._service.create_sampling_client(model_path=policy.adapter_path),
            f"the sampling client for {policy.adapter_path}",
        )
        self._clients[policy.model_name] = client

    async def unload_adapter(self, policy: Policy) -> None:
        self._clients.pop(policy.model_name, None)

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        client = self._clients.get(policy.model_name)
        if client is None:
            raise BackendError(503, f"no Tinker sampling client for {policy.model_name}")
        params = build_sampling_params(self._tinker, req.max_tokens, req.sampling)
        prompt = self._tinker.ModelInput.from_ints(req.prompt_token_ids)
        response = await self._resolve(
            client.sample(prompt=prompt, num_samples=req.n, sampling_params=params), "a sample request"
        )
        return [
            Sample(
                token_ids=list(seq.tokens),
                logprobs=[float(x) for x in (seq.logprobs or [])],
                finish_reason=str(seq.stop_reason),
            )
            for seq in response.sequences
        ]

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        if body.get("echo"):
            raise BackendError(400, "echo is not supported by the Tinker sampler")
        chat = path.endswith("/chat/completions")
        if chat:
            text = self.tokenizer.apply_chat_template(
                body.get("messages") or [], add_generation_prompt=True, tokenize=False
            )
            prompt_ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        else:
            prompt = body.get("prompt", "")
            prompt_ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        sampling = {k: body[k] for k in SUPPORTED_KEYS if body.get(k) is not None}
        samples = await self.sample(
            SamplingRequest(
                prompt_token_ids=prompt_ids,
                n=int(body.get("n") or 1),
                max_tokens=max_tokens,
                sampling=sampling,
            ),
            policy,
        )
        want_logprobs = bool(body.get("logprobs"))
        choices = [self._choice(i, s, chat, want_logprobs) for i, s in enumerate(samples)]
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": policy.model_name,
            "choices": choices,
            "prompt_token_ids": prompt_ids,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": sum(len(s.token_ids) for s in samples),
                "total_tokens": len(prompt_ids) + sum(len(s.token_ids) for s in samples),
            },
        }

    def _choice(self, index: int, s: Sample, chat: bool, want_logprobs: bool) -> dict[str, Any]:
        text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        pieces = [self.tokenizer.decode([t]) for t in s.token_ids] if want_logprobs else []
        choice: dict[str, Any] = {"index": index, "finish_reason": s.finish_reason, "token_ids": s.token_ids}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = (
                {
                    "content": [
                        {"token": p, "logprob": lp, "top_logprobs": []} for p, lp in zip(pieces, s.logprobs)
                    ]
                }
                if want_logprobs
                else None
            )
        else:
            choice["text"] = text
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": s.logprobs} if want_logprobs else None
        return choice
