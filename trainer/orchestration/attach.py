"""A run attached to a shared engine (`launch.sh engine`): `bash launch.sh ENV inference.engine_url=URL` starts
run-api, the environments and the trainer only, against the engine's gateway and vLLM.

The engine writes a record per URL into runs/engines/ (mode 0600: it holds the publish token); the launcher reads
the token from it (or from inference.publish_token). The run holds the engine through a lease (inference/http/
engine.py) renewed by a thread of the launcher; the lease id is kept in the run's config.yaml
(inference.engine_lease), so a resumed run attaches as the same run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from inference.wire import LEASE_HEADER, AttachRequest, AttachResponse, EngineStatus
from rlcommon.model_identity import model_identity
from trainer.orchestration.commands import ROOT
from trainer.training.config import ENGINE_KEYS, ConfigError, RunConfig

ENGINES = ROOT / "runs" / "engines"  # one record per running engine: its URL, publish token, folder and PID
ATTACH_KEYS = ENGINE_KEYS  # inference.* keys of the run, not of a gateway
RENEW_EVERY_S = 3.0
# How the engine runs its vLLM, not what it serves: a run may state other values and still attach.
OPERATIONAL_VLLM_KEYS = frozenset({"api_key", "port", "startup_timeout_s", "max_restarts"})
WAIT_EVERY_S = 2.0


def record_path(url: str) -> Path:
    parsed = httpx.URL(url)
    return ENGINES / f"{re.sub(r'[^A-Za-z0-9.-]', '_', parsed.host)}-{parsed.port}.json"


def write_record(url: str, token: str, folder: Path, pid: int, model: str) -> Path:
    """The engine's record (0600): what an attaching run on this machine needs, the token included."""
    path = record_path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600, exist_ok=True)
    tmp.chmod(0o600)
    body = {"url": url, "publish_token": token, "folder": str(folder), "pid": pid, "model": model}
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    return path


def engine_token(url: str, given: str | None) -> str:
    if given:
        return given
    path = record_path(url)
    try:
        return str(json.loads(path.read_text())["publish_token"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"inference.engine_url={url}: no engine record at {path} ({type(exc).__name__}); start the engine on "
            "this machine with `bash launch.sh engine`, or pass inference.publish_token=TOKEN (the "
            "publish_token in the engine's record)"
        ) from None


def new_holder(run_dir: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", run_dir.name)[:80] or "run"
    return f"{stem}-{secrets.token_hex(6)}"


class EngineLease:
    """The run's hold on the engine: attach (waiting for the holder to go with `wait`), renew from a thread,
    release at the end. `lost` says why, once the lease is gone for good (another run took the engine)."""

    def __init__(self, url: str, token: str, holder: str, who: str, request: AttachRequest):
        self.url, self.holder, self.who = url, holder, who
        self.request = request
        self.headers = {"Authorization": f"Bearer {token}"}
        self.status: EngineStatus | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _post(self, path: str, body: dict[str, Any], timeout_s: float = 30.0) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=timeout_s)

    def attach(self, wait: bool) -> AttachResponse:
        said = False
        while True:
            try:
                reply = self._post("/engine/attach", self.request.model_dump(mode="json"), 120.0)
            except httpx.HTTPError as exc:
                raise ConfigError(
                    f"inference.engine_url={self.url}: no engine answers there ({type(exc).__name__}: {exc}); "
                    "start one with `bash launch.sh engine`"
                ) from None
            if reply.status_code == 200:
                answer = AttachResponse.model_validate(reply.json())
                self.status = answer.engine
                return answer
            error = _error_of(reply)
            if error.get("type") == "lease_held" and wait:
                if not said:
                    print(f"launch.sh: waiting for the engine: {error.get('message')}", flush=True)
                    said = True
                time.sleep(WAIT_EVERY_S)
                continue
            if reply.status_code == 404:
                raise ConfigError(f"inference.engine_url={self.url}: a gateway of a run, not a shared engine")
            raise ConfigError(f"the engine at {self.url} refused the run: {error.get('message', reply.text)}")

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="engine-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        ttl = self.status.lease_ttl_s if self.status else 3 * RENEW_EVERY_S
        while not self._stop.wait(min(RENEW_EVERY_S, ttl / 3)):
            try:
                reply = self._post("/engine/renew", {"holder": self.holder}, 10.0)
            except httpx.HTTPError:
                continue  # the engine's gateway is restarting: its supervisor brings it back
            if reply.status_code == 200:
                continue
            # A restarted gateway forgot every lease: take it again (the engine is ours unless another run has it).
            try:
                self.attach(wait=False)
                print(
                    "launch.sh: attached to the engine again (its gateway restarted, or the lease lapsed)",
                    flush=True,
                )
            except ConfigError as exc:
                self.lost = f"the run lost the engine's lease: {exc}"
                print(f"launch.sh: {self.lost}", flush=True)
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        try:
            self._post("/engine/release", {"holder": self.holder}, 10.0)
        except httpx.HTTPError as exc:
            print(f"launch.sh: could not release the engine's lease ({exc}); it lapses by itself", flush=True)


def _error_of(reply: httpx.Response) -> dict[str, Any]:
    try:
        error = reply.json().get("error")
    except ValueError:
        return {}
    return error if isinstance(error, dict) else {}


def attach_run(cfg: RunConfig, run_dir: Path, model_path: str, wait: bool) -> EngineLease:
    """Attach the run to cfg.inference.engine_url: the engine's gateway becomes the run's, with its token, the run's
    lease id and the engine's vLLM dtype (the trainer picks its verification statistic from it) written into cfg."""
    url = str(cfg.inference["engine_url"]).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"inference.engine_url={url!r}: give the engine's URL (http://HOST:PORT)")
    if cfg.launch.backend != "local":
        raise ConfigError(
            "inference.engine_url: an engine serves the local backend; drop it with --backend tinker"
        )
    token = engine_token(url, cfg.inference.get("publish_token"))
    holder = str(cfg.inference.get("engine_lease") or new_holder(run_dir))
    who = f"the run in {run_dir} (launcher PID {os.getpid()} on {socket.gethostname()})"
    request = AttachRequest(
        holder=holder, who=who, model=model_identity(model_path), max_staleness=cfg.rollout.max_staleness
    )
    lease = EngineLease(url, token, holder, who, request)
    answer = lease.attach(wait)
    engine = answer.engine
    differs = vllm_differences(cfg.inference.get("vllm") or {}, engine.vllm)
    if differs:
        lease.release()
        raise ConfigError(
            f"the engine at {url} runs vLLM with other settings than the run asks for ("
            + "; ".join(differs)
            + "): drop them from the run, or start an engine with them (bash launch.sh engine --config FILE)"
        )
    cfg.launch.gateway_url = url
    cfg.inference["publish_token"] = token
    cfg.inference["engine_lease"] = holder
    cfg.inference["vllm"] = {**(cfg.inference.get("vllm") or {}), "dtype": engine.vllm_dtype}
    started = "a clean policy state" if answer.new_run else "the policy state this run left"
    print(
        f"attached to the engine at {url} (run {engine.runs} on it, {started}; model {engine.model.name})",
        flush=True,
    )
    return lease


def vllm_differences(wanted: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """The run's inference.vllm settings the engine's vLLM does not have ('auto' dtype: whatever it runs)."""
    out = []
    for key, value in sorted(wanted.items()):
        if key in OPERATIONAL_VLLM_KEYS or (key == "dtype" and value == "auto") or key not in served:
            continue
        if served[key] != value:
            out.append(f"inference.vllm.{key}: the run's {value!r}, the engine's {served[key]!r}")
    return out


def lease_headers(cfg: RunConfig) -> dict[str, str]:
    """The header a run attached to an engine sends on publish, expect and refill."""
    holder = cfg.inference.get("engine_lease")
    return {LEASE_HEADER: str(holder)} if holder and cfg.inference.get("engine_url") else {}


def write_attached(run_dir: Path, lease: EngineLease) -> None:
    """RUN_DIR/engine.json: the run ran on a shared engine, and which (never its token)."""
    status = lease.status
    body = {
        "engine_url": lease.url,
        "engine_instance": status.instance if status else None,
        "engine_model": status.model.name if status else None,
        "run_on_engine": status.runs if status else None,
        "lease": lease.holder,
        "attached_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (run_dir / "engine.json").write_text(json.dumps(body, indent=1))
