"""Training runs and checkpoints over REST: the routes of the SDK's RestClient that a local service has a use for, and
the record they read.

- A training run is a training client's folder (service.output_dir/<model id>/) holding a `run.json`: its id, base
  model, LoRA spec, the `user_metadata` it was created with, and per named checkpoint its save time, expiry
  (`ttl_seconds`) and `user_metadata`. The checkpoints are the folders on disk (`weights/NAME`,
  `sampler_weights/NAME`, unnamed snapshots included), so the listings survive a restart and show what is there.
- A checkpoint saved with `ttl_seconds` (or given one by set_checkpoint_ttl) is deleted by a reaper, folder and
  record, within a second of its expiry.
- An unknown run or checkpoint answers 404 (the SDK raises NotFoundError); bad input 400 naming the field
  (BadRequestError, the SDK's user-error category); what the SDK offers and a one-user local service has no use for
  (publishing, copies into projects, external weights, sessions search, billing) is refused by name, also 400.
- Nothing is deleted outside the service's folder: a run id is looked up among the runs (never used as a path), and
  a checkpoint name must be a plain name of a complete checkpoint folder of that run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from trainer.service.wire import UserError

log = logging.getLogger("trainer.service")

API = "/api/v1"
SCHEME = "tinker://"
RUN_FILE = "run.json"
ONE = "/training_runs/{run_id}/checkpoints/{kind}/{name}"  # one checkpoint's route
# path segment -> the SDK's checkpoint_type
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
COMPLETE = {
    "weights": "state.json",
    "sampler_weights": "adapter_config.json",
    "external_weights": "adapter_config.json",
}  # each kind's file written last
MAX_TTL_S = 10 * 365 * 24 * 3600  # the SDK's documented upper bound
REAP_EVERY_S = 1.0
OWNER = "local"  # model_owner of every run: the service has one user


class NotFound(Exception):
    """An unknown run or checkpoint: answered 404, which the SDK raises as NotFoundError."""


# --- input -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveOptions:
    """What save_state / save_weights_for_sampler attach to a named checkpoint."""

    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


MAX_METADATA_ENTRIES = 64  # user_metadata of a run or checkpoint: labels, not data
MAX_METADATA_CHARS = 16384


def parse_user_metadata(value: Any, where: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise UserError(f"{where}.user_metadata must be an object with non-empty string keys, got {value!r}")
    bad = {k: v for k, v in value.items() if not isinstance(v, str)}
    if bad:
        raise UserError(
            f"{where}.user_metadata values must be strings (the SDK reads them as str), got {str(bad)[:200]!r}"
        )
    size = sum(len(k) + len(v) for k, v in value.items())
    if len(value) > MAX_METADATA_ENTRIES or size > MAX_METADATA_CHARS:
        # Every listing of runs carries it: 48 MB of it made each listing ~1 s of the event loop and 96 MB long.
        raise UserError(
            f"{where}.user_metadata has {len(value)} entries of {size} characters; at most "
            f"{MAX_METADATA_ENTRIES} entries and {MAX_METADATA_CHARS} characters in all"
        )
    return dict(value)


def parse_ttl(value: Any, where: str) -> int | None:
    """None: never expires. Unlike the hosted service (an hour at least), any positive number of seconds."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TTL_S:
        raise UserError(
            f"{where}.ttl_seconds must be an integer of seconds in [1, {MAX_TTL_S}] or null, got {value!r}"
        )
    return value


def parse_save_options(body: dict[str, Any], where: str) -> SaveOptions:
    return SaveOptions(
        parse_ttl(body.get("ttl_seconds"), where), parse_user_metadata(body.get("user_metadata"), where)
    )


def _iso(unix: float) -> str:
    """Always with microseconds, so that the strings sort as the times do."""
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="microseconds")


def _split(checkpoint_id: str) -> tuple[str, str]:
    """weights/NAME, sampler_weights/NAME or external_weights/NAME -> (kind, NAME), the name checked to be a plain
    folder name."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in KINDS:
        raise UserError(
            f"checkpoint_id {checkpoint_id!r}: expected weights/NAME, sampler_weights/NAME or external_weights/NAME"
        )
    if not name or "/" in name or "\0" in name or name.startswith("."):
        raise UserError(
            f"checkpoint_id {checkpoint_id!r}: NAME must be a plain name (no '/', not starting '.')"
        )
    check_name_length(name, "checkpoint_id")
    return kind, name


MAX_NAME_BYTES = (
    255  # a folder name on Linux file systems: a longer one is an OSError, not a missing checkpoint
)


def check_name_length(name: str, where: str) -> None:
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise UserError(
            f"{where}: a checkpoint name of {len(name.encode('utf-8', 'surrogatepass'))} bytes; names are at most "
            f"{MAX_NAME_BYTES} bytes (they are folder names)"
        )


# --- the record --------------------------------------------------------------------------------------------------


class Catalog:
    """Runs and checkpoints: each run's `run.json`, and in memory the run folders and the pending expiries. Saves
    write from the training thread, REST calls and the reaper from the event loop: one lock around each rewrite."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()
        self.runs: dict[str, Path] = {}  # run id -> its folder
        self.expiries: dict[tuple[str, str], float] = {}  # (run id, checkpoint id) -> unix time
        for file in sorted(root.glob(f"*/{RUN_FILE}")):
            try:
                record = json.loads(file.read_text())
                run_id = record["training_run_id"]
            except (OSError, ValueError, KeyError) as exc:
                log.warning("skipping %s, not a run record (%s)", file, exc)
                continue
            self.runs[run_id] = file.parent
            for checkpoint_id, entry in record.get("checkpoints", {}).items():
                if entry.get("expires_at") is not None:
                    self.expiries[(run_id, checkpoint_id)] = float(entry["expires_at"])

    def _read(self, run_id: str) -> dict[str, Any]:
        return dict(json.loads((self.run_folder(run_id) / RUN_FILE).read_text()))

    def _update(self, run_id: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Read, change and rewrite a run's record atomically (a crash leaves the old or the new one)."""
        with self.lock:
            record = self._read(run_id)
            change(record)
            target = self.run_folder(run_id) / RUN_FILE
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, target)

    def open_run(
        self,
        run_id: str,
        folder: Path,
        base_model: str,
        lora: dict[str, Any],
        user_metadata: dict[str, str] | None,
    ) -> None:
        """A new training client (create_model, or create_training_client_from_state)."""
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "training_run_id": run_id,
            "base_model": base_model,
            "lora": lora,
            "user_metadata": user_metadata,
            "created": time.time(),
            "checkpoints": {},
        }
        (folder / RUN_FILE).write_text(json.dumps(record, indent=1))
        self.runs[run_id] = folder

    def saved(self, run_id: str, kind: str, name: str, options: SaveOptions) -> None:
        """A named checkpoint was written (an overwrite replaces its record: TTL and metadata included)."""
        checkpoint_id, now = f"{kind}/{name}", time.time()
        expires = None if options.ttl_seconds is None else now + options.ttl_seconds
        entry = {"time": now, "expires_at": expires, "user_metadata": options.user_metadata}
        self._update(run_id, lambda r: r["checkpoints"].__setitem__(checkpoint_id, entry))
        self._expire_at(run_id, checkpoint_id, expires)

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        self.checkpoint_folder(run_id, checkpoint_id)  # exists
        expires = None if ttl_seconds is None else time.time() + ttl_seconds

        def change(record: dict[str, Any]) -> None:
            entry = record["checkpoints"].setdefault(checkpoint_id, {})
            entry["expires_at"] = expires

        self._update(run_id, change)
        self._expire_at(run_id, checkpoint_id, expires)

    def _expire_at(self, run_id: str, checkpoint_id: str, expires: float | None) -> None:
        if expires is None:
            self.expiries.pop((run_id, checkpoint_id), None)
        else:
            self.expiries[(run_id, checkpoint_id)] = expires

    def forget(self, run_id: str, checkpoint_id: str) -> None:
        """The checkpoint's folder is gone: its record goes too."""
        self.expiries.pop((run_id, checkpoint_id), None)
        self._update(run_id, lambda r: r["checkpoints"].pop(checkpoint_id, None))

    def due(self, now: float) -> list[tuple[str, str]]:
        return [key for key, expires in list(self.expiries.items()) if expires <= now]

    # --- lookups ----------------------------------------------------------------------------------------------

    def run_folder(self, run_id: str) -> Path:
        folder = self.runs.get(run_id)
        if folder is None:
            raise NotFound(f"no training run {run_id!r} on this service")
        return folder

    def checkpoint_folder(self, run_id: str, checkpoint_id: str) -> Path:
        """The folder of an existing, complete checkpoint of the run; never a path outside the run's kind folder."""
        kind, name = _split(checkpoint_id)
        parent = self.run_folder(run_id) / kind
        folder = parent / name
        if (
            folder.is_symlink()
            or not (folder / COMPLETE[kind]).is_file()
            or folder.resolve().parent != parent.resolve()
        ):
            raise NotFound(f"no checkpoint {checkpoint_id!r} in training run {run_id!r}")
        return folder

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        """The run's checkpoints (Checkpoint), newest first."""
        entries = self._read(run_id)["checkpoints"]
        found = []
        for kind in KINDS:
            parent = self.run_folder(run_id) / kind
            for folder in sorted(parent.iterdir()) if parent.is_dir() else []:
                if (
                    folder.name.startswith(".")
                    or folder.is_symlink()
                    or not (folder / COMPLETE[kind]).is_file()
                ):
                    continue  # being written, or not a checkpoint
                try:
                    found.append(
                        self._checkpoint(run_id, kind, folder, entries.get(f"{kind}/{folder.name}", {}))
                    )
                except FileNotFoundError:
                    continue  # deleted while listed
        return sorted(found, key=lambda c: c["time"], reverse=True)

    @staticmethod
    def _checkpoint(run_id: str, kind: str, folder: Path, entry: dict[str, Any]) -> dict[str, Any]:
        expires = entry.get("expires_at")
        return {
            "checkpoint_id": f"{kind}/{folder.name}",
            "checkpoint_type": KINDS[kind],
            "time": _iso(entry.get("time") or folder.stat().st_mtime),
            "tinker_path": f"{SCHEME}{run_id}/{kind}/{folder.name}",
            "size_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
            "public": False,
            "user_metadata": entry.get("user_metadata"),
            "expires_at": None if expires is None else _iso(expires),
            "training_run_id": run_id,
        }

    def run(self, run_id: str) -> dict[str, Any]:
        """The run as the SDK's TrainingRun."""
        record, folder = self._read(run_id), self.run_folder(run_id)
        checkpoints = self.checkpoints(run_id)
        metrics = folder / "metrics.jsonl"
        last = max(record["created"], metrics.stat().st_mtime if metrics.exists() else 0.0)
        return {
            "training_run_id": run_id,
            "base_model": record["base_model"],
            "model_owner": OWNER,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": record["lora"]["rank"],
            "last_request_time": _iso(last),
            "last_checkpoint": next((c for c in checkpoints if c["checkpoint_type"] == "training"), None),
            "last_sampler_checkpoint": next(
                (c for c in checkpoints if c["checkpoint_type"] == "sampler"), None
            ),
            "user_metadata": record["user_metadata"],
            "created": _iso(record["created"]),
        }

    def weights_info(self, tinker_path: Any) -> dict[str, Any]:
        run_id, checkpoint_id = parse_tinker_path(tinker_path, "tinker_path")
        self.checkpoint_folder(run_id, checkpoint_id)
        record = self._read(run_id)
        lora = record["lora"]
        return {
            "base_model": record["base_model"],
            "is_lora": True,
            "lora_rank": lora["rank"],
            **{k: lora[k] for k in ("train_unembed", "train_mlp", "train_attn")},
        }


def parse_tinker_path(path: Any, where: str) -> tuple[str, str]:
    """tinker://RUN/weights/NAME -> (RUN, weights/NAME), as the SDK's ParsedCheckpointTinkerPath splits it."""
    parts = path[len(SCHEME) :].split("/") if isinstance(path, str) and path.startswith(SCHEME) else []
    if len(parts) != 3 or not parts[0]:
        raise UserError(
            f"{where} {path!r}: expected tinker://RUN_ID/weights/NAME or tinker://RUN_ID/sampler_weights/NAME"
        )
    return parts[0], f"{parts[1]}/{parts[2]}"


# --- deleting ----------------------------------------------------------------------------------------------------


class Service(Protocol):
    """What these routes use of trainer.service.app.Service: a protocol, since app imports this module."""

    catalog: Catalog
    sampler: Any  # trainer.service.sampling.GatewaySampler, or None without a gateway
    samplers: dict[str, Any]  # sampler id -> app.Sampler
    snapshots: dict[str, deque[Any]]  # model id -> its unnamed snapshots (app.Sampler), oldest first
    adapter_of: dict[Path, str]  # sampler folder -> its adapter's name in the gateway


async def delete_checkpoint(service: Service, run_id: str, checkpoint_id: str) -> None:
    """A checkpoint goes: sampler weights are first dropped from the sampling sessions and vLLM, then the folder,
    then its record."""
    folder = service.catalog.checkpoint_folder(run_id, checkpoint_id)
    if checkpoint_id.startswith("sampler_weights/"):
        await release_sampler_folder(service, folder, f"{SCHEME}{run_id}/{checkpoint_id}")
    # Out of sight first, in one rename: a delete cut short (a kill, a full disk) leaves a hidden folder that no
    # listing shows and no load reads, never a half checkpoint that still lists.
    doomed = folder.with_name(f".deleting-{folder.name}-{os.getpid()}")
    await asyncio.to_thread(os.rename, folder, doomed)
    service.catalog.forget(run_id, checkpoint_id)
    await asyncio.to_thread(shutil.rmtree, doomed, True)
    log.info("deleted checkpoint %s%s/%s", SCHEME, run_id, checkpoint_id)


async def release_sampler_folder(service: Service, folder: Path, path: str) -> None:
    """Sampler weights about to go: their sampling sessions end and vLLM unloads them (refused while one of their
    samples is in flight: vLLM would lose the adapter under it)."""
    adapter = service.adapter_of.get(folder)
    if adapter is not None and service.sampler is not None and service.sampler.in_flight.get(adapter):
        raise UserError(f"{path} is being sampled right now: delete it once those samples are back")
    for sampler_id in [s for s, spec in list(service.samplers.items()) if spec.folder == folder]:
        service.samplers.pop(sampler_id, None)
    for model_id, line in list(service.snapshots.items()):
        service.snapshots[model_id] = deque(s for s in line if s.folder != folder)
    service.adapter_of.pop(folder, None)
    if adapter is not None and service.sampler is not None:
        await service.sampler.forget(adapter)


async def reap_expired(service: Service) -> None:
    """Delete checkpoints past their expiry, checking every REAP_EVERY_S."""
    while True:
        for run_id, checkpoint_id in service.catalog.due(time.time()):
            try:
                await delete_checkpoint(service, run_id, checkpoint_id)
            except NotFound:  # already gone (deleted by hand, or an unnamed snapshot the service dropped)
                service.catalog.forget(run_id, checkpoint_id)
            except UserError as exc:  # being sampled: next round
                log.info("expired checkpoint not deleted yet: %s", exc)
            except Exception:
                log.exception("deleting expired checkpoint %s/%s failed", run_id, checkpoint_id)
                service.catalog.expiries.pop((run_id, checkpoint_id), None)  # not retried every second
        await asyncio.sleep(REAP_EVERY_S)


# --- routes ------------------------------------------------------------------------------------------------------


def _int_param(request: Request, key: str, default: int, upper: int) -> int:
    raw = request.query_params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= upper:
        raise UserError(f"query parameter {key!r} must be an integer in [0, {upper}], got {raw!r}")
    return value


def _scope(request: Request) -> None:
    scope = request.query_params.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise UserError(f"access_scope must be 'owned' or 'accessible', got {scope!r}")


def _page(
    items: list[dict[str, Any]], request: Request, default_limit: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    limit = _int_param(request, "limit", default_limit, 10_000)
    offset = _int_param(request, "offset", 0, 10**9)
    return items[offset : offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


async def json_body(request: Request) -> dict[str, Any]:
    """A request's JSON object body (an empty body is {}); anything else is the caller's error."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise UserError(f"the body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise UserError("the body must be a JSON object")
    return body


def runs_routes(service: Service) -> APIRouter:
    """get_training_run[_by_tinker_path], list_training_runs, get_weights_info_by_tinker_path."""
    router, catalog = APIRouter(), service.catalog

    @router.get(f"{API}/training_runs")
    async def list_training_runs(request: Request) -> dict[str, Any]:
        _scope(request)
        if request.query_params.get("project_id") is not None:
            raise UserError("project_id: this service has no projects; list without one")
        runs = sorted((catalog.run(r) for r in list(catalog.runs)), key=lambda r: r["created"], reverse=True)
        page, cursor = _page(runs, request, 20)
        return {"training_runs": page, "cursor": cursor}

    @router.get(f"{API}/training_runs/{{run_id}}")
    async def get_training_run(run_id: str, request: Request) -> dict[str, Any]:
        _scope(request)
        return catalog.run(run_id)

    @router.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        return catalog.weights_info((await json_body(request)).get("tinker_path"))

    return router


def checkpoint_routes(service: Service) -> APIRouter:
    """list_checkpoints, list_user_checkpoints, delete_checkpoint[_from_tinker_path], set_checkpoint_ttl."""
    router, catalog = APIRouter(), service.catalog
    one = f"{API}{ONE}"

    @router.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def list_checkpoints(run_id: str) -> dict[str, Any]:
        return {"checkpoints": catalog.checkpoints(run_id), "cursor": None}

    @router.get(f"{API}/checkpoints")
    async def list_user_checkpoints(request: Request) -> dict[str, Any]:
        every = [c for run_id in list(catalog.runs) for c in catalog.checkpoints(run_id)]
        page, cursor = _page(sorted(every, key=lambda c: c["time"], reverse=True), request, 100)
        return {"checkpoints": page, "cursor": cursor}

    @router.delete(one)
    async def delete(run_id: str, kind: str, name: str) -> JSONResponse:
        await delete_checkpoint(service, run_id, f"{kind}/{name}")
        return JSONResponse(None)

    @router.put(f"{one}/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request) -> JSONResponse:
        ttl = parse_ttl((await json_body(request)).get("ttl_seconds"), "set_checkpoint_ttl")
        catalog.set_ttl(run_id, f"{kind}/{name}", ttl)
        return JSONResponse(None)

    return router


# What the SDK's RestClient (and AdminClient) offers that a one-user local service does not: (method, route, the
# SDK's name for it, why not).
PUBLIC = "one user, nothing is public"
REFUSED = [
    ("POST", f"{ONE}/publish", "publish_checkpoint_from_tinker_path", PUBLIC),
    ("DELETE", f"{ONE}/publish", "unpublish_checkpoint_from_tinker_path", PUBLIC),
    ("POST", "/copy_weights", "copy_weights", "there are no projects to copy into"),
    ("GET", "/sessions", "list_sessions", "sessions are not listed"),
    ("GET", "/sessions/{session_id}", "get_session", "sessions are not listed"),
    ("PUT", "/sessions/{session_id}/project", "assign_session_project", "there are no projects"),
    ("GET", "/sessions/{session_id}/trace_export", "export_session_trace", "there are no session traces"),
    ("POST", "/sessions/search", "search_sessions", "sessions are not listed"),
    ("GET", "/audit", "get_audit_log", "there is no audit log"),
    ("GET", "/billing/usage/events", "get_billing_usage", "there is no billing"),
    ("GET", "/billing/usage/checkpoints/current", "get_current_checkpoint_storage_usage", "no billing"),
]


def refused_routes() -> APIRouter:
    router = APIRouter()
    for method, route, name, why in REFUSED:
        router.add_api_route(f"{API}{route}", _refusal(name, why), methods=[method], include_in_schema=False)
    return router


def _refusal(name: str, why: str) -> Callable[[], Any]:
    async def refuse() -> None:
        raise UserError(f"{name} is not supported by this service: {why}")

    return refuse


def install(app: FastAPI, service: Service) -> None:
    """The REST routes, their 404 for unknown runs and checkpoints, and the TTL reaper (started with the app)."""

    async def not_found(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    async def start_reaper() -> None:
        app.state.checkpoint_reaper = asyncio.get_running_loop().create_task(reap_expired(service))

    app.add_exception_handler(NotFound, not_found)
    app.router.add_event_handler("startup", start_reaper)
    for router in (runs_routes(service), checkpoint_routes(service), refused_routes()):
        app.include_router(router)
