"""The sampling half of the Tinker-protocol service: the SDK's sample requests turned into the gateway's
POST /adapters/generate, and its answers into the SDK's protobuf SampleResponse.

decode_sample / encode_sample are pure (no I/O). StabilityRecords keeps what a sampling client created with
`record_stability_info=True` sampled, by sequence_id, for stable_reinforce to train on: the prompt, the sampled tokens
and the sampler's logprob of each, all of which vLLM answers anyway (nothing extra is asked of the gateway).
GatewaySampler does the HTTP: each sampler adapter is loaded into the gateway's vLLM under a name of its own on first
use, loaded again when the gateway answers that it does not hold it (it restarted), and unloaded when more than
`keep_loaded` are loaded (least recently used first, never one with a request running). Must not touch the training
clients' weights: sampler folders are written by the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_delay, wait_random_exponential
from tinker.proto import tinker_public_pb2 as pb

from inference.wire import NamedSampleResponse, Sample
from trainer.service.wire import SequenceRecord, UserError
from trainer.training.retries import describe, is_transient

log = logging.getLogger("trainer.service.sampling")

MAX_SAMPLES = 1024  # the gateway's bound on n
MAX_TOP_K = 20  # vLLM's default --max-logprobs
MASK_LOGPROB = -99999.0  # the SDK's empty top-k cell
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
# Tinker keeps a recorded sequence trainable for one day after its last use (sampling, or a training request that
# names it); the token bound keeps a long run's records from growing without limit (least recently used go first).
RECORD_TTL_S = 86400.0
MAX_RECORDED_BYTES = (
    512 * 2**20
)  # what stable_reinforce's records may hold in memory, their Python objects counted
# A record's Python objects (its key, the record, three array headers, the dict entry) beyond its arrays: 661 bytes
# a one-token record in all (tracemalloc, 20,000 records); a bound in tokens alone let such records take ~20x it.
RECORD_OVERHEAD_BYTES = 700


@dataclass(frozen=True)
class SampleCall:
    prompt: list[int]
    num_samples: int
    body: dict[str, Any]  # the gateway's /adapters/generate body, without "adapter"
    prompt_logprobs: bool
    top_k_prompt: int
    last_n: int | None
    record_stability: bool = False  # keep each sequence for stable_reinforce (record_stability_info)


def _prompt_tokens(prompt: Any, vocab_size: int) -> list[int]:
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise UserError(f"prompt: expected a ModelInput with chunks, got {prompt!r:.120}")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise UserError(
                f"prompt chunk {i}: type {kind!r} is not supported (this service serves text models: send "
                "encoded_text chunks)"
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"prompt chunk {i}: tokens must be a list of integers")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise UserError(f"prompt chunk {i}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        tokens.extend(ids)
    if not tokens:
        raise UserError("prompt: no tokens")
    return tokens


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise UserError(f"{key} must be an integer from {low} to {high}, got {value!r}")
    return value


def _unsupported(body: dict[str, Any]) -> None:
    if body.get("target_prompt_logprobs") is not None:
        raise UserError("target_prompt_logprobs is not supported by this service; use topk_prompt_logprobs")
    for key in ("prompt_alt_tokens_k", "topk_sample_logprobs"):
        if body.get(key):
            raise UserError(f"{key} is not supported by this service; send 0")


def _sampling(params: Any, prompt_len: int, context: int | None) -> dict[str, Any]:
    """Tinker's SamplingParams as the gateway's sampling keys."""
    if not isinstance(params, dict):
        raise UserError(f"sampling_params must be an object, got {params!r:.120}")
    out: dict[str, Any] = {}
    max_tokens = params.get("max_tokens")
    if max_tokens is None:  # Tinker's default: until a stop or the end of the context
        if context is None:
            raise UserError(
                "sampling_params.max_tokens is required (the sampler's context length is unknown)"
            )
        max_tokens = context - prompt_len
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise UserError(
            f"sampling_params.max_tokens must be a positive integer, got {max_tokens!r}"
            + (f" (the prompt has {prompt_len} of the context's {context} tokens)" if context else "")
        )
    out["max_tokens"] = max_tokens
    for key, low, high in (("temperature", 0.0, 1e4), ("top_p", 1e-9, 1.0)):
        value = params.get(key, 1.0)
        if not isinstance(value, int | float) or not math.isfinite(value) or not low <= value <= high:
            raise UserError(f"sampling_params.{key} must be a number from {low:g} to {high:g}, got {value!r}")
        out[key] = float(value)
    top_k = params.get("top_k", -1)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k == 0 or top_k < -1:
        raise UserError(f"sampling_params.top_k must be -1 (off) or a positive integer, got {top_k!r}")
    if top_k > 0:
        out["top_k"] = top_k
    seed = params.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63:
            raise UserError(f"sampling_params.seed must be a 64-bit integer, got {seed!r}")
        out["seed"] = seed
    out.update(_stops(params.get("stop")))
    return out


def _stops(stop: Any) -> dict[str, Any]:
    if stop is None:
        return {}
    if isinstance(stop, str):
        return {"stop": [stop]}
    if isinstance(stop, list) and not stop:  # Tinker: [] disables every stop, EOS included
        return {"ignore_eos": True}
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return {"stop": stop}
    if isinstance(stop, list) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stop
    ):
        return {"stop_token_ids": stop}
    raise UserError(
        f"sampling_params.stop must be a string, a list of strings or of token ids, got {stop!r:.120}"
    )


def decode_sample(body: dict[str, Any], vocab_size: int, context: int | None) -> SampleCall:
    """The SDK's SampleRequest (JSON) as a gateway request; UserError for what this service cannot honour."""
    _unsupported(body)
    prompt = _prompt_tokens(body.get("prompt"), vocab_size)
    num_samples = _int(body, "num_samples", 1, 1, MAX_SAMPLES)
    top_k = _int(body, "topk_prompt_logprobs", 0, 0, MAX_TOP_K)
    want_prompt = bool(body.get("prompt_logprobs")) or top_k > 0
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not want_prompt:
            raise UserError("prompt_logprobs_last_n applies to prompt logprobs: set prompt_logprobs")
        last_n = _int(body, "prompt_logprobs_last_n", 1, 1, max(1, len(prompt) - 1))
    sampling = _sampling(body.get("sampling_params"), len(prompt), context)
    gateway_body: dict[str, Any] = {
        "prompt": {"prompt_token_ids": prompt},
        "n": num_samples,
        **sampling,
    }
    if want_prompt:
        gateway_body["prompt_logprobs"] = top_k
    record = body.get("record_stability_info")
    if record is not None and not isinstance(record, bool):
        raise UserError(f"record_stability_info must be true or false, got {record!r:.60}")
    return SampleCall(
        prompt, num_samples, gateway_body, bool(body.get("prompt_logprobs")), top_k, last_n, bool(record)
    )


def sequence_ids(sampling_session_id: str, seq_id: Any, count: int) -> list[str]:
    """The ids the asample promise gives the request's sequences, in order; they begin with the session's id (the
    sampling session's does), which is how a training request's provenance is kept within its session."""
    return [f"{sampling_session_id}:{seq_id}:{i}" for i in range(count)]


@dataclass
class StabilityRecords:
    """What the sampler recorded for stable_reinforce, by sequence_id. Lives on the event loop (sampling and the
    decoding of training requests both run there): no lock."""

    ttl_s: float = RECORD_TTL_S
    max_bytes: int = MAX_RECORDED_BYTES
    clock: Callable[[], float] = time.monotonic
    _records: OrderedDict[str, tuple[SequenceRecord, float]] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def __len__(self) -> int:
        return len(self._records)

    def record(self, ids: list[str], prompt: list[int], samples: list[Sample]) -> None:
        if len(ids) != len(samples):
            raise RuntimeError(f"{len(ids)} sequence ids for {len(samples)} samples")
        shared = np.asarray(prompt, np.int32)
        now = self.clock()
        for sequence_id, s in zip(ids, samples, strict=True):
            if len(s.logprobs) != len(s.token_ids):
                raise RuntimeError(
                    f"the sampler answered {len(s.token_ids)} tokens with {len(s.logprobs)} logprobs"
                )
            self._drop(sequence_id)  # a retried request reuses its ids: the newest answer wins
            entry = SequenceRecord(
                shared, np.asarray(s.token_ids, np.int32), np.asarray(s.logprobs, np.float32)
            )
            self._records[sequence_id] = (entry, now)
            self._bytes += _size(entry)
        self._expire(now)

    def get(self, sequence_id: str) -> SequenceRecord | None:
        """The record, its day restarted; None when there is none (never recorded, expired, evicted, forgotten)."""
        now = self.clock()
        self._expire(now)
        found = self._records.get(sequence_id)
        if found is None:
            return None
        self._records[sequence_id] = (found[0], now)
        self._records.move_to_end(sequence_id)
        return found[0]

    def forget(self, prefix: str) -> None:
        """A finished session's records go with it."""
        for sequence_id in [k for k in self._records if k.startswith(prefix)]:
            self._drop(sequence_id)

    def _drop(self, sequence_id: str) -> None:
        old = self._records.pop(sequence_id, None)
        if old is not None:
            self._bytes -= _size(old[0])

    def _expire(self, now: float) -> None:
        # Least recently used first, so the oldest use is always at the front.
        while self._records:
            sequence_id, (_, used) = next(iter(self._records.items()))
            if now - used <= self.ttl_s and self._bytes <= self.max_bytes:
                return
            self._drop(sequence_id)


def _size(entry: SequenceRecord) -> int:
    """Bytes a record holds: its arrays (the prompt's counted with each of its request's sequences, which share it:
    the safe side) and its objects."""
    return RECORD_OVERHEAD_BYTES + entry.prompt.nbytes + entry.tokens.nbytes + entry.logprobs.nbytes


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, np.float32)
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = token, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def encode_sample(call: SampleCall, samples: list[Sample]) -> bytes:
    """The gateway's samples as the SDK's protobuf SampleResponse."""
    out = pb.SampleResponse()
    for s in samples:
        if s.finish_reason not in _STOP_REASONS:
            raise RuntimeError(f"the sampler ended a sequence with {s.finish_reason!r}")
        out.sequences.add(
            stop_reason=_STOP_REASONS[s.finish_reason],
            tokens=np.asarray(s.token_ids, np.int32).tobytes(),
            logprobs=np.asarray(s.logprobs, np.float32).tobytes(),
        )
    if call.prompt_logprobs or call.top_k_prompt:
        positions = samples[0].prompt_logprobs if samples else None
        if positions is None or len(positions) != len(call.prompt):
            raise RuntimeError("the sampler answered without the prompt logprobs that were asked for")
        first_scored = 1 if call.last_n is None else len(call.prompt) - call.last_n
        own = np.full(len(call.prompt), np.nan, np.float32)
        tops: list[list[tuple[int, float]] | None] = [None] * len(call.prompt)
        for i in range(max(1, first_scored), len(call.prompt)):
            pos = positions[i] or {}
            # vLLM writes -9999.0 for -inf; the prompt token's own entry is always there
            own[i] = pos.get(call.prompt[i], float("nan"))
            tops[i] = sorted(pos.items(), key=lambda kv: -kv[1])[: call.top_k_prompt]
        if call.prompt_logprobs:
            out.prompt_logprobs = own.tobytes()
        if call.top_k_prompt:
            out.topk_prompt_logprobs.CopyFrom(_topk(tops, call.top_k_prompt))
    return bytes(out.SerializeToString())


def _message(r: httpx.Response) -> str:
    """The gateway's error message (its OpenAI-shaped body), or the start of whatever it sent."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:500]


@dataclass
class GatewaySampler:
    """Samples through the gateway's named adapters, loading each on first use (and after a gateway restart)."""

    url: str
    token: str | None = None
    keep_loaded: int = 8
    budget_s: float = 300.0
    loaded: OrderedDict[str, str] = field(default_factory=OrderedDict)  # name -> folder, least recent first
    in_flight: dict[str, int] = field(default_factory=dict)
    context: int | None = None  # the sampler's max_model_len, read once from GET /v1/models
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=600.0)
        return self._client

    async def _post(self, path: str, body: dict[str, Any], what: str) -> httpx.Response:
        """POST, retried on connection errors and 502/503/504 within the budget; other answers are returned."""

        async def once() -> httpx.Response:
            r = await self.client.post(path, json=body)
            if r.status_code in (502, 503, 504):
                r.raise_for_status()
            return r

        retrying = AsyncRetrying(
            stop=stop_after_delay(self.budget_s),
            wait=wait_random_exponential(multiplier=0.5, max=10.0),
            retry=retry_if_exception(is_transient),
        )
        try:
            return await retrying(once)
        except RetryError as exc:
            raise RuntimeError(
                f"the gateway at {self.url} kept failing for {self.budget_s:.0f}s on {what} "
                f"({describe(exc.last_attempt.exception())})"
            ) from None

    async def read_context(self) -> int | None:
        if self.context is None:
            with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
                r = await self.client.get("/v1/models", timeout=30)
                self.context = int(r.json()["data"][0]["max_model_len"])
        return self.context

    async def _load(self, name: str, folder: str) -> None:
        r = await self._post("/adapters/load", {"name": name, "adapter_path": folder}, f"loading {name}")
        if r.status_code != 200:
            message = _message(r)
            if r.status_code < 500:  # the adapter itself (a rank above inference.vllm.max_lora_rank, ...)
                raise UserError(f"the sampler cannot load these weights ({folder}): {message}")
            raise RuntimeError(f"the gateway failed to load sampler adapter {name} ({folder}): {message}")
        self.loaded[name] = folder
        self.loaded.move_to_end(name)
        log.info("sampler adapter %s loaded from %s", name, folder)

    async def _evict(self) -> None:
        for name in list(self.loaded):
            if len(self.loaded) <= self.keep_loaded:
                return
            if self.in_flight.get(name):
                continue
            r = await self._post("/adapters/unload", {"name": name}, f"unloading {name}")
            if r.status_code == 200:
                self.loaded.pop(name, None)

    async def ensure(self, name: str, folder: str) -> None:
        async with self._lock:
            if name in self.loaded:
                self.loaded.move_to_end(name)
                return
            await self._load(name, folder)
            await self._evict()

    async def forget(self, name: str) -> None:
        """The adapter's folder is going away: unload it (it is not sampled again)."""
        async with self._lock:
            if self.loaded.pop(name, None) is not None:
                await self._post("/adapters/unload", {"name": name}, f"unloading {name}")

    async def sample(self, adapter: tuple[str, str] | None, body: dict[str, Any]) -> list[Sample]:
        """Samples of `body` on `adapter` (name, folder; None: the base model)."""
        name = adapter[0] if adapter else None
        if name is not None:
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
        try:
            for attempt in range(3):
                if adapter is not None:
                    await self.ensure(*adapter)
                r = await self._post("/adapters/generate", {**body, "adapter": name}, "sampling")
                if r.status_code == 404 and adapter is not None and attempt < 2:
                    self.loaded.pop(adapter[0], None)  # the gateway restarted without it: load it again
                    continue
                if r.status_code >= 400:
                    message = _message(r)
                    if r.status_code < 500:
                        raise UserError(f"the sampler refused the request: {message}")
                    raise RuntimeError(f"the sampler failed ({r.status_code}): {message}")
                return NamedSampleResponse.model_validate(r.json()).samples
            raise RuntimeError(f"the gateway lost sampler adapter {name} three times in a row")
        finally:
            if name is not None:
                self.in_flight[name] -= 1
                if not self.in_flight[name]:
                    del self.in_flight[name]
