"""save_weights_external and the download of what it saved: how a client takes a trained adapter off the service
(`python -m trainer export` of a `--backend tinker` run uses it, as it would with hosted Tinker).

`save_weights_external(name)` writes the client's adapter as a standard PEFT folder (adapter_config.json and
adapter_model.safetensors, as vLLM and PEFT load it) to tinker://MODEL_ID/external_weights/NAME, a checkpoint that is
listed, deleted and expires like the others. `get_external_weights_urls` answers one download URL per file, signed
with a key this process drew at start and valid for URL_TTL_S: the URL itself is the credential (the download route
sits outside /api/v1 and its key check, as a bucket's signed URL does), so it can be handed to a tool that has no
API key. A restarted service signs with a new key: URLs from before are refused, as expired ones are.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from trainer.service.calls import Calls
from trainer.service.checkpoints import API, NotFound, json_body, parse_save_options
from trainer.service.wire import Result, UserError, body_field, call_of


class Service(Protocol):
    """What these routes use of the service (trainer/service/app.py)."""

    policies: Any
    catalog: Any
    calls: Calls

    def model_name(self, model_id: str) -> str: ...
    def state_folder(self, model_id: str, kind: str, name: str) -> Path: ...
    def record(self, model_id: str, row: dict[str, Any]) -> None: ...


KIND = "external_weights"
DOWNLOAD = "/external_weights"  # /external_weights/RUN/NAME/FILE?expires=UNIX&sig=HEX
URL_TTL_S = 3600


class Signer:
    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def sign(self, path: str, expires: int) -> str:
        return hmac.new(self._key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def valid(self, path: str, expires: int, sig: str) -> bool:
        return time.time() < expires and hmac.compare_digest(self.sign(path, expires), sig)


def save_external(service: Service, model_id: str, name: str, body: dict[str, Any]) -> Result:
    if body.get("age_encryption_recipients"):
        raise UserError(
            "save_weights_external: age_encryption_recipients are not supported by this service (its files are "
            "written unencrypted under service.output_dir); send none"
        )
    folder = service.state_folder(model_id, KIND, name)
    if folder.exists():
        raise UserError(f"external weights {name!r} exist already for {model_id}: pick another name")
    options = parse_save_options(body, "save_weights_external")
    service.policies.save_for_sampler(service.model_name(model_id), folder)
    service.catalog.saved(model_id, KIND, name, options)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    service.record(model_id, {"call": "save_weights_external", "path": str(folder)})
    path = f"tinker://{model_id}/{KIND}/{name}"
    return Result({"path": path, "size_bytes": size, "type": "save_weights_external"})


def external_weights_routes(service: Service) -> APIRouter:
    router = APIRouter()
    signer = Signer()

    @router.post(f"{API}/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, str]:
        body = await json_body(request)
        (model_id, seq_id), name = call_of(body), body_field(body, "path", str)
        work = lambda: save_external(service, model_id, name, body)  # noqa: E731
        return {"request_id": service.calls.submit(work, model_id, seq_id)}

    @router.get(f"{API}/training_runs/{{run_id}}/checkpoints/{KIND}/{{name}}/external_weights_urls")
    async def urls(run_id: str, name: str, request: Request) -> JSONResponse:
        folder = service.catalog.checkpoint_folder(run_id, f"{KIND}/{name}")
        expires = int(time.time()) + URL_TTL_S
        base = str(request.base_url).rstrip("/")
        found = {}
        for file in sorted(f for f in folder.rglob("*") if f.is_file()):
            rel = file.relative_to(folder).as_posix()
            path = f"{DOWNLOAD}/{run_id}/{name}/{rel}"
            found[rel] = f"{base}{path}?expires={expires}&sig={signer.sign(path, expires)}"
        return JSONResponse({"urls": found, "expires": datetime.fromtimestamp(expires, UTC).isoformat()})

    @router.get(f"{DOWNLOAD}/{{run_id}}/{{name}}/{{rel:path}}")
    async def download(run_id: str, name: str, rel: str, expires: int = 0, sig: str = "") -> Response:
        path = f"{DOWNLOAD}/{run_id}/{name}/{rel}"
        if not signer.valid(path, expires, sig):
            message = "this download URL is expired or not signed by this service: ask get_external_weights_urls again"
            return JSONResponse({"detail": message}, status_code=403)
        folder = service.catalog.checkpoint_folder(run_id, f"{KIND}/{name}")
        file = (folder / rel).resolve()
        if not file.is_file() or not file.is_relative_to(folder.resolve()):
            raise NotFound(f"no file {rel!r} in {KIND}/{name} of training run {run_id!r}")
        return FileResponse(file)

    return router
