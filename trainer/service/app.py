"""The work behind the local Tinker-protocol service's routes (trainer/service/routes.py): sessions and their reaper,
training clients (models), their checkpoints, and sampler snapshots. Calls are queued and answered through futures
(trainer/service/calls.py): training on one worker thread in each client's seq_id order, sampling concurrently.

- A refused call (bad datum, unknown loss, unknown model) is a result in the SDK's error format, `{"error",
  "category": "user"}`, which the SDK raises as RequestFailedError; it still takes its place in the client's order.
- Sampling goes through the gateway (`service.gateway_url`, started beside the service by `bash launch.sh
  service`): each sampler snapshot is a PEFT folder loaded into the gateway's vLLM under a name of its own
  (trainer/service/sampling.py). Sample calls run concurrently on the event loop, never on the training thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.service.calls import Calls
from trainer.service.checkpoints import (
    Catalog,
    check_name_length,
    parse_save_options,
    parse_user_metadata,
)
from trainer.service.policies import LoraSpec, MultiLora
from trainer.service.sampling import (
    GatewaySampler,
    SampleCall,
    StabilityRecords,
    decode_sample,
    encode_sample,
    sequence_ids,
)
from trainer.service.wire import (
    ForwardBackwardCall,
    Result,
    UserError,
    body_field,
    encode_forward_backward,
)
from trainer.training.backend import AdamParams
from trainer.training.config import RunConfig

log = logging.getLogger("trainer.service")

API = "/api/v1"  # the SDK's routes; /health sits outside it

TINKER_SCHEME = "tinker://"
SNAPSHOT_PREFIX = "snapshot-"  # unnamed sampler snapshots (save_weights_and_get_sampling_client)


def safe_name(model_id: str) -> str:
    return model_id.replace(":", "_").replace("/", "_")


@dataclass(frozen=True)
class Sampler:
    """A sampling session: the base model (folder None) or one saved adapter, and the training client it came from."""

    sampler_id: str
    model_id: str | None
    model_path: str | None  # tinker://... (None for the base model)
    folder: Path | None
    adapter: str | None  # its name in the gateway


class Service:
    def __init__(self, cfg: RunConfig, policies: MultiLora):
        self.cfg = cfg
        self.policies = policies
        self.root = Path(cfg.service.output_dir)
        self.catalog = Catalog(self.root)  # training runs and checkpoints, read back from disk
        self.calls = Calls(cfg.service.poll_hold_s)  # the futures the SDK polls, each client's calls in order
        self.models: dict[str, str] = {}  # model id -> adapter name
        self.adapters = itertools.count()
        self.beats: dict[str, float] = {}  # session id -> its last heartbeat (monotonic)
        self.reaper: asyncio.Task[None] | None = None
        self.samplers: dict[str, Sampler] = {}
        # per training client, its unnamed snapshots, oldest first
        self.snapshots: dict[str, deque[Sampler]] = {}
        self.adapter_of: dict[Path, str] = {}  # sampler folder -> its name in the gateway (loaded once)
        self.instance = secrets.token_hex(4)  # gateway adapter names stay unique across service restarts
        self.adapter_names = itertools.count()
        self.snapshot_names = itertools.count()
        # what the samplers created with record_stability_info sampled, for stable_reinforce
        self.stability = StabilityRecords()
        self.sampler = (
            None
            if cfg.service.gateway_url is None
            else GatewaySampler(
                cfg.service.gateway_url, cfg.service.gateway_token, cfg.service.max_loaded_samplers
            )
        )

    def capabilities(self) -> dict[str, Any]:
        """The quickstart's first call (RestClient.get_server_capabilities): the one base this service trains."""
        limits = [self.cfg.trainer.max_seq_len, (self.cfg.inference.get("vllm") or {}).get("max_model_len")]
        return {
            "supported_models": [
                {
                    "model_name": self.cfg.model.path,
                    "max_context_length": min(n for n in limits if isinstance(n, int)),
                    "trainable": True,
                    "sampleable": self.cfg.service.sampling,
                }
            ]
        }

    # --- training clients -------------------------------------------------------------------------------------

    def start_reaper(self) -> None:
        if self.reaper is None:
            self.reaper = asyncio.get_running_loop().create_task(self.reap())

    async def reap(self) -> None:
        """End sessions whose SDK stopped heartbeating (every 10 s) for service.session_timeout_s: a script that
        crashed or was killed must not hold its adapters, Adam state and snapshots until the service restarts."""
        timeout = self.cfg.service.session_timeout_s
        while True:
            await asyncio.sleep(min(10.0, timeout / 4))
            now = time.monotonic()
            for session_id, beat in list(self.beats.items()):
                if now - beat > timeout:
                    log.warning(
                        "session %s sent no heartbeat for %.0fs: releasing its clients",
                        session_id,
                        now - beat,
                    )
                    self.end_session(session_id)

    def end_session(self, session_id: str) -> None:
        """Release a session's training clients (after the calls already queued) and its sampling sessions."""
        self.beats.pop(session_id, None)
        request_id = self.calls.submit(lambda: self.release_session(session_id))
        released = self.calls.futures.pop(request_id)  # nobody polls for it

        async def samplers() -> None:
            await released
            await self.release_samplers(f"{session_id}:")

        asyncio.get_running_loop().create_task(samplers())

    async def release_samplers(self, prefix: str) -> None:
        """Forget the session's sampling sessions; its unnamed snapshots are unloaded and deleted (named sampler
        weights stay on disk)."""
        # Copies first: the training thread registers samplers (save_weights_and_get_sampling_client) meanwhile.
        for sampler_id in [s for s in list(self.samplers) if s.startswith(prefix)]:
            self.samplers.pop(sampler_id)
        self.stability.forget(prefix)
        for model_id in [m for m in list(self.snapshots) if m.startswith(prefix)]:
            for old in self.snapshots.pop(model_id):
                await self.delete_snapshot(old)

    def release_session(self, session_id: str) -> Result:
        """The SDK's close(): the session's training clients are gone (their saved states stay on disk)."""
        prefix = f"{session_id}:train:"
        for model_id in [m for m in self.models if m.startswith(prefix)]:
            self.policies.release(self.models.pop(model_id))
            self.calls.order.pop(model_id, None)
            self.record(model_id, {"call": "release"})
        return Result({})

    def model_name(self, model_id: str) -> str:
        name = self.models.get(model_id)
        if name is None:
            raise UserError(f"no training client {model_id!r} on this service (was the service restarted?)")
        return name

    def info(self, model_id: str) -> dict[str, Any]:
        """get_info: the client's base model and LoRA rank."""
        name = self.model_name(model_id)
        return {
            "model_id": model_id,
            "model_data": {
                "model_name": self.cfg.model.path,
                "arch": self.policies.arch,
                "tokenizer_id": self.policies.model_path,
            },
            "is_lora": True,
            "lora_rank": self.policies.clients[name].spec.rank,
        }

    def create_model(
        self, model_id: str, base_model: str, lora: dict[str, Any], user_metadata: Any = None
    ) -> Result:
        if base_model not in (self.cfg.model.path, self.policies.model_path):
            raise UserError(f"this service trains {self.cfg.model.path!r}, not {base_model!r}")
        if model_id in self.models:
            return Result({"model_id": model_id})  # a retried create
        session = model_id.partition(":train:")[0]
        if session not in self.beats:
            # A client under a session this service never opened (or has ended) is one no reaper would free.
            raise UserError(
                f"create_model: no open session {session!r} on this service; open one with create_session (the "
                "SDK's ServiceClient does) and keep it alive with its heartbeats"
            )
        metadata = parse_user_metadata(user_metadata, "create_model")
        if len(self.models) >= self.cfg.service.max_clients:
            raise UserError(
                f"service.max_clients={self.cfg.service.max_clients} training clients exist already"
            )
        rank = lora.get("rank")
        if not isinstance(rank, int) or rank < 1:
            raise UserError(f"lora_config.rank must be a positive integer, got {rank!r}")
        spec = LoraSpec(
            rank=rank,
            seed=int(lora.get("seed") or 0),
            train_attn=bool(lora.get("train_attn", True)),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
        )
        name = f"m{next(self.adapters)}"
        try:
            self.policies.create(name, spec)
        except ValueError as exc:  # the flags select none of this model's modules
            raise UserError(str(exc)) from None
        self.models[model_id] = name
        self.calls.line(model_id)
        self.catalog.open_run(model_id, self.root / safe_name(model_id), base_model, spec.__dict__, metadata)
        self.record(model_id, {"call": "create_model", **spec.__dict__})
        log.info("training client %s: LoRA rank %d (%s)", model_id, rank, ", ".join(spec.targets()))
        return Result({"model_id": model_id})

    def forward_backward(self, call: ForwardBackwardCall) -> Result:
        name = self.model_name(call.model_id)
        started = time.perf_counter()
        logprobs, loss, metrics = self.policies.forward_backward(
            name,
            call.examples,
            call.loss,
            backward=not call.forward_only,
            soft_targets=call.soft_targets,
            sequence_masks=call.sequence_masks,
        )
        self.record(
            call.model_id,
            {
                "call": "forward" if call.forward_only else "forward_backward",
                "seq_id": call.seq_id,
                "loss_fn": call.loss.name,
                "loss": loss,
                "datums": len(call.examples),
                "tokens": metrics["tokens:sum"],
                "seconds": time.perf_counter() - started,
            },
        )
        return Result(encode_forward_backward(logprobs, metrics), proto=True)

    def optim_step(self, model_id: str, seq_id: int, adam: dict[str, Any] | None) -> Result:
        name = self.model_name(model_id)
        defaults = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}
        values = {**defaults, "weight_decay": 0.0, "grad_clip_norm": 0.0, **(adam or {})}
        try:
            params = AdamParams(**{k: float(values[k]) for k in AdamParams.__dataclass_fields__})
        except (TypeError, ValueError) as exc:
            raise UserError(f"adam_params: {exc}") from None
        if params.learning_rate < 0 or not 0 <= params.beta1 < 1 or not 0 <= params.beta2 < 1:
            raise UserError(f"adam_params out of range: {params}")
        started = time.perf_counter()
        metrics = self.policies.optim_step(name, params)
        self.record(
            model_id,
            {
                "call": "optim_step",
                "seq_id": seq_id,
                "lr": params.learning_rate,
                **metrics,
                "seconds": time.perf_counter() - started,
            },
        )
        return Result({"metrics": metrics})

    def state_folder(self, model_id: str, kind: str, name: str) -> Path:
        """service.output_dir/<model id>/<kind>/<name>; a model id or name that would lead elsewhere (`..`, a
        hidden or empty part, a separator) is refused: a tinker path never reaches outside its run."""
        if not name or "/" in name or name.startswith("."):
            raise UserError(f"checkpoint name {name!r}: use a plain name (letters, digits, -_.)")
        check_name_length(name, "checkpoint name")
        run = safe_name(model_id)
        if not run or run.startswith(".") or "\\" in run:
            raise UserError(
                f"model id {model_id!r}: not a model id this service gave (tinker://MODEL_ID/...)"
            )
        return self.root / run / kind / name

    def resolve(self, path: str) -> Path:
        """tinker://MODEL_ID/weights/NAME -> its folder."""
        if not path.startswith(TINKER_SCHEME):
            raise UserError(
                f"path {path!r}: expected tinker://MODEL_ID/weights/NAME as save_state returned it"
            )
        parts = path[len(TINKER_SCHEME) :].split("/")
        if len(parts) != 3 or parts[1] != "weights":
            raise UserError(
                f"path {path!r}: expected tinker://MODEL_ID/weights/NAME as save_state returned it"
            )
        folder = self.state_folder(parts[0], "weights", parts[2])
        if not (folder / "state.json").exists():
            raise UserError(f"no saved state at {path} ({folder} has none)")
        return folder

    def save_state(self, model_id: str, name: str, body: dict[str, Any]) -> Result:
        adapter = self.model_name(model_id)
        folder = self.state_folder(model_id, "weights", name)
        options = parse_save_options(body, "save_state")
        self.policies.save_state(adapter, folder)
        self.catalog.saved(model_id, "weights", name, options)
        self.record(model_id, {"call": "save_state", "path": str(folder)})
        return Result({"path": f"{TINKER_SCHEME}{model_id}/weights/{name}"})

    def load_state(self, model_id: str, path: str, optimizer: bool, user_metadata: Any = None) -> Result:
        folder = self.resolve(path)
        created = model_id not in self.models
        if created:  # create_training_client_from_state: a new client from the state
            spec = {**self.policies.read_spec(folder).__dict__}
            self.create_model(model_id, self.cfg.model.path, spec, user_metadata)
        try:
            self.policies.load_state(self.models[model_id], folder, optimizer)
        except Exception as exc:
            if created:  # a client that never got its state holds no max_clients slot
                self.policies.release(self.models.pop(model_id))
                self.calls.order.pop(model_id, None)
            if isinstance(exc, ValueError | OSError):  # OSError: the folder went between resolve and the read
                raise UserError(f"loading {path}: {exc}") from None
            raise
        self.record(model_id, {"call": "load_state", "path": path, "optimizer": optimizer})
        return Result({"path": path, "model_id": model_id})

    def save_for_sampler(
        self, model_id: str, name: str | None, session_seq: int | None, body: dict[str, Any]
    ) -> Result:
        """A PEFT folder of the client's adapter: named (persistent, tinker://.../sampler_weights/NAME), or an unnamed
        snapshot for save_weights_and_get_sampling_client, answered with its sampling session."""
        adapter = self.model_name(model_id)
        snapshot = not name
        if snapshot:
            if session_seq is None:
                raise UserError("save_weights_for_sampler: send a path (name) or a sampling_session_seq_id")
            self.sampling_enabled()
            name = f"{SNAPSHOT_PREFIX}{next(self.snapshot_names)}"
        elif str(name).startswith(SNAPSHOT_PREFIX):
            raise UserError(
                f"sampler weights name {name!r}: names starting {SNAPSHOT_PREFIX!r} are the service's own"
            )
        assert name is not None
        folder = self.state_folder(model_id, "sampler_weights", name)
        if folder.exists():
            raise UserError(f"sampler weights {name!r} exist already for {model_id}: pick another name")
        options = parse_save_options(body, "save_weights_for_sampler")
        self.policies.save_for_sampler(adapter, folder)
        if not snapshot:
            self.catalog.saved(model_id, "sampler_weights", name, options)
        path = f"{TINKER_SCHEME}{model_id}/sampler_weights/{name}"
        self.record(model_id, {"call": "save_weights_for_sampler", "path": str(folder)})
        if not snapshot:
            return Result({"path": path})
        sampler = self.new_sampler(model_id, path, folder, f"{model_id}:sample:{session_seq}")
        self.snapshots.setdefault(model_id, deque()).append(sampler)
        return Result({"path": path, "sampling_session_id": sampler.sampler_id})

    def new_sampler(
        self, model_id: str | None, path: str | None, folder: Path | None, sampler_id: str
    ) -> Sampler:
        adapter = None
        if folder is not None:
            adapter = self.adapter_of.setdefault(folder, f"{self.instance}-{next(self.adapter_names)}")
        sampler = Sampler(sampler_id, model_id, path, folder, adapter)
        self.samplers[sampler_id] = sampler
        return sampler

    def drop_old_snapshots_after(self, request_id: str, model_id: str) -> None:
        """Once the snapshot being saved under `request_id` exists, the client's oldest ones beyond the kept number go."""
        saved = self.calls.futures[request_id]

        async def tidy() -> None:
            await asyncio.shield(saved)
            await self.drop_old_snapshots(model_id)

        asyncio.get_running_loop().create_task(tidy())

    async def drop_old_snapshots(self, model_id: str) -> None:
        """Keep the newest service.sampler_snapshots_kept unnamed snapshots of a client (8B rank-32 ones are
        ~170 MB each, one per RL step); older ones are unloaded and deleted unless a request is sampling them."""
        kept, line = self.cfg.service.sampler_snapshots_kept, self.snapshots.get(model_id)
        while line is not None and len(line) > kept:
            old = line[0]
            assert self.sampler is not None and old.adapter is not None and old.folder is not None
            if self.sampler.in_flight.get(old.adapter):
                return  # next time
            line.popleft()
            await self.delete_snapshot(old)

    async def delete_snapshot(self, old: Sampler) -> None:
        """An unnamed snapshot goes: its sampling session, its adapter in vLLM, its folder."""
        assert old.folder is not None and old.adapter is not None
        self.samplers.pop(old.sampler_id, None)
        self.adapter_of.pop(old.folder, None)
        if self.sampler is not None:
            await self.sampler.forget(old.adapter)
        await asyncio.to_thread(shutil.rmtree, old.folder, True)

    def sampling_enabled(self) -> GatewaySampler:
        if self.sampler is None:
            raise UserError(
                "sampling needs the gateway: start the service with `bash launch.sh service`, which starts one, or "
                "set service.gateway_url"
            )
        return self.sampler

    def create_sampler(self, body: dict[str, Any]) -> str:
        self.sampling_enabled()
        session_id, seq = (
            body_field(body, "session_id", str),
            body_field(body, "sampling_session_seq_id", int),
        )
        sampler_id = f"{session_id}:sample:{seq}"
        if sampler_id in self.samplers:
            return sampler_id  # a retried create
        path, base = body.get("model_path"), body.get("base_model")
        if path is None:
            if base not in (self.cfg.model.path, self.policies.model_path):
                raise UserError(f"this service samples {self.cfg.model.path!r}, not {base!r}")
            self.new_sampler(None, None, None, sampler_id)
            return sampler_id
        model_id, folder = self.resolve_sampler_path(str(path))
        self.new_sampler(model_id, str(path), folder, sampler_id)
        return sampler_id

    def resolve_sampler_path(self, path: str) -> tuple[str, Path]:
        parts = path.removeprefix(TINKER_SCHEME).split("/")
        if not path.startswith(TINKER_SCHEME) or len(parts) != 3 or parts[1] != "sampler_weights":
            raise UserError(
                f"model_path {path!r}: expected tinker://MODEL_ID/sampler_weights/NAME as save_weights_for_sampler "
                "returned it"
            )
        folder = self.state_folder(parts[0], "sampler_weights", parts[2])
        if not (folder / "adapter_config.json").exists():
            raise UserError(
                f"no sampler weights at {path} ({folder} has none; unnamed snapshots are deleted "
                f"once {self.cfg.service.sampler_snapshots_kept} newer ones exist)"
            )
        return parts[0], folder

    async def sample(self, body: dict[str, Any]) -> Result:
        sampler_id = body_field(body, "sampling_session_id", str)
        spec = self.samplers.get(sampler_id)
        if spec is None:
            raise UserError(
                f"no sampling session {sampler_id!r} here (a snapshot older than the newest "
                f"{self.cfg.service.sampler_snapshots_kept} of its training client, or the service restarted)"
            )
        gateway = self.sampling_enabled()
        call: SampleCall = decode_sample(body, self.policies.vocab_size, await gateway.read_context())
        started = time.perf_counter()
        adapter = None if spec.adapter is None else (spec.adapter, str(spec.folder))
        samples = await gateway.sample(adapter, call.body)
        answer = encode_sample(call, samples)
        if call.record_stability:
            ids = sequence_ids(sampler_id, body.get("seq_id"), call.num_samples)
            self.stability.record(ids, call.prompt, samples)
        self.record(
            spec.model_id or "base",
            {
                "call": "sample",
                "sampler": sampler_id,
                "num_samples": call.num_samples,
                "prompt_tokens": len(call.prompt),
                "sampled_tokens": sum(len(s.token_ids) for s in samples),
                "seconds": time.perf_counter() - started,
            },
        )
        return Result(answer, proto=True)

    def record(self, model_id: str, row: dict[str, Any]) -> None:
        """One metrics.jsonl row per call, in the client's own folder."""
        folder = self.root / safe_name(model_id)
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"unix_time": time.time(), "model_id": model_id, **row}) + "\n")
