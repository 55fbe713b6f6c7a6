"""Several vLLM replicas behind the one gateway: requests go to the least busy ready replica that holds the
request's policy; a publish loads the adapter on every ready replica before the version switches; a replica that
dies is restarted by its own supervisor and caught up (adapters loaded or unloaded to match the registry) while
the others keep serving. With one replica this is a thin pass-through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from inference.errors import BackendError
from inference.policy.registry import Policy
from inference.polling import poll_until
from inference.samplers.vllm import VLLMBackend
from inference.wire import Sample, SamplingRequest

log = logging.getLogger("inference.replicas")
RECONCILE_S = 0.5


class ReplicaSet:
    def __init__(self, replicas: list[VLLMBackend], wanted: Callable[[], list[Policy]]):
        if not replicas:
            raise ValueError("need at least one replica")
        self.replicas = replicas
        shared = replicas[0].quarantine  # a request that killed one replica and then another is held too
        for r in replicas:
            r.quarantine = shared
        self.wanted = wanted  # the adapters every replica should hold (the registry's loaded policies)
        self._busy: Counter[int] = Counter()
        self._reconciler: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._started = False  # healthy only once every replica has had its first start

    # --- what the app reads -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return ",".join(r.url for r in self.replicas)

    @property
    def pid(self) -> int | None:
        return self.replicas[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    @property
    def ready(self) -> bool:
        return self._started and any(r.ready for r in self.replicas)

    @property
    def state(self) -> str:
        if not self._started:
            return "starting"
        states = {r.state for r in self.replicas}
        for candidate in ("ready", "starting", "restarting", "failed"):
            if candidate in states:
                return candidate
        return "stopped"

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    @property
    def restart_reasons(self) -> list[str]:
        return [f"replica {i}: {why}" for i, r in enumerate(self.replicas) for why in r.restart_reasons][-10:]

    @property
    def max_model_len(self) -> int | None:
        return next((r.max_model_len for r in self.replicas if r.max_model_len is not None), None)

    # --- lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> None:
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if len(failures) == len(self.replicas):
            raise failures[0]
        for exc in failures:
            log.error("a replica failed to start: %s", exc)
        self._started = True
        self._reconciler = asyncio.create_task(self._reconcile_forever())

    async def stop(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconciler
        await asyncio.gather(*(r.stop() for r in self.replicas))

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_S)
            try:
                await self.reconcile()
            except BackendError as exc:
                log.warning("catching a replica up failed (will retry): %s", exc.message)

    async def reconcile(self) -> None:
        """Bring every ready replica's adapters in line with the registry (after a restart, or a missed publish)."""
        async with self._lock:
            wanted = {p.model_name: p for p in self.wanted() if p.adapter_path}
            for replica in self.replicas:
                if not replica.ready:
                    continue
                for name in sorted(set(wanted) - replica.loaded):
                    await replica.load_adapter(wanted[name])
                for name in sorted(replica.loaded - set(wanted)):
                    await replica.unload_adapter(Policy(-1, name, None))

    # --- requests ---------------------------------------------------------------------------------------

    def _holders(self, policy: Policy) -> list[int]:
        return [
            i
            for i, r in enumerate(self.replicas)
            if r.ready and (policy.adapter_path is None or policy.model_name in r.loaded)
        ]

    async def _route(self, policy: Policy, call: Callable[[VLLMBackend], Any]) -> Any:
        for attempt in range(2):
            holders = await self._wait_for_holders(policy)
            index = min(holders, key=lambda i: self._busy[i])
            self._busy[index] += 1
            try:
                return await call(self.replicas[index])
            except BackendError as exc:
                if exc.status != 503 or attempt == 1 or len(self.replicas) == 1:
                    raise
                log.warning("replica %d failed a request (%s); trying another", index, exc.message)
            finally:
                self._busy[index] -= 1
        raise AssertionError("unreachable")

    async def _wait_for_holders(self, policy: Policy) -> list[int]:
        """Replicas that can serve `policy` now; if none (all restarting, or catching up), wait for one."""

        async def holders() -> list[int]:
            if all(r.state in ("failed", "stopped") for r in self.replicas):
                raise BackendError(503, "every vLLM replica has failed")
            return self._holders(policy)

        found = await poll_until(holders, self.replicas[0].cfg.vllm.startup_timeout_s, 0.1)
        if not found:
            raise BackendError(503, f"no vLLM replica holds {policy.model_name}")
        return found

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        result: list[Sample] = await self._route(policy, lambda r: r.sample(req, policy))
        return result

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        result: dict[str, Any] = await self._route(policy, lambda r: r.forward(path, body, policy))
        return result

    def validate_adapter(self, path: str) -> None:
        """Called in a worker thread (the app's publish and named loads): it reads files only."""
        self.replicas[0].validate_adapter(path)

    async def load_adapter(self, policy: Policy) -> None:
        """On every ready replica before returning (so before the version switches). A replica that dies meanwhile
        is skipped: routing never sends it this policy until the reconciler has loaded it after its restart."""
        async with self._lock:
            ready = [r for r in self.replicas if r.ready]
            if not ready:
                raise BackendError(503, "no vLLM replica is up to load the adapter on")
            results = await asyncio.gather(*(r.load_adapter(policy) for r in ready), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if len(errors) == len(ready):
            raise errors[0]
        for replica, result in zip(ready, results):
            if isinstance(result, BaseException):
                log.warning(
                    "loading %s on %s failed (%s); it will catch up after it is back",
                    policy.model_name,
                    replica.url,
                    result,
                )

    async def unload_adapter(self, policy: Policy) -> None:
        async with self._lock:
            await asyncio.gather(
                *(
                    r.unload_adapter(policy)
                    for r in self.replicas
                    if r.ready and policy.model_name in r.loaded
                )
            )
