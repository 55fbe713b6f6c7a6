"""A shared engine (launch.sh engine) without vLLM: the lease's rules, and the gateway's /engine routes against a
scripted sampler: one run at a time, a clean policy state for each new run, the model checked, a lapsed lease."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from inference.app import create_app
from inference.config import GatewayConfig
from inference.policy.lease import LeaseBook, LeaseHeld
from inference.policy.registry import PolicyRegistry
from inference.wire import LEASE_HEADER
from rlcommon.model_identity import model_identity
from tests.scripted_gateway import ScriptedBackend, make_adapter, publish_body
from trainer.orchestration.attach import ATTACH_KEYS, lease_headers, vllm_differences
from trainer.orchestration.launcher import gateway_section
from trainer.training.config import RunConfig

TOKEN = "engine-token-0123456789abcdef"


def test_one_holder_at_a_time_and_a_silent_one_lapses():
    book = LeaseBook(ttl_s=10.0)
    assert book.attach("run-a", "run A", now=0.0) is True
    assert book.attach("run-a", "run A again", now=1.0) is False  # the same run: renewed, no new run
    with pytest.raises(LeaseHeld) as held:
        book.attach("run-b", "run B", now=2.0)
    assert held.value.lease.who == "run A again" and held.value.expires_in_s == pytest.approx(9.0)
    assert book.renew("run-a", now=9.0) and not book.renew("run-b", now=9.0)
    assert book.holds("run-a", now=18.9) and not book.holds(None, now=18.9)
    assert book.current(now=19.5) is None and book.lapsed == 1  # ten seconds without a renewal
    # Late renewals, nobody else attached meanwhile: the engine still holds that run's state, which stays.
    assert book.attach("run-a", "run A", now=19.6) is False and book.runs == 1
    assert book.current(now=30.0) is None and book.lapsed == 2
    assert book.attach("run-b", "run B", now=30.0) is True and book.runs == 2
    assert not book.release("run-a", now=31.0) and book.release("run-b", now=31.0)
    assert book.current(now=31.0) is None and book.lapsed == 2
    assert book.attach("run-a", "run A", now=32.0) is True and book.runs == 3  # run B came between: a new run


def fake_model(root: Path, hidden: int = 8) -> Path:
    folder = root / f"model-{hidden}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w" * hidden)
    return folder


def engine_client(model: Path, ttl_s: float = 30.0) -> tuple[httpx.AsyncClient, ScriptedBackend]:
    backend = ScriptedBackend()
    cfg = GatewayConfig(
        model=str(model),
        vllm={"max_lora_rank": 8},
        keep_versions=1,
        engine=True,
        lease_ttl_s=ttl_s,
        publish_token=TOKEN,
    )
    app = create_app(cfg, backend, PolicyRegistry("base", 1), vocab_size=100, start_backend=False)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://127.0.0.1",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    return client, backend


def attach_body(holder: str, model: Path, max_staleness: int = 1) -> dict:
    identity = model_identity(model).model_dump()
    return {"holder": holder, "who": f"the run {holder}", "model": identity, "max_staleness": max_staleness}


async def test_each_attached_run_starts_clean_and_only_the_holder_steers_the_policy(tmp_path):
    model = fake_model(tmp_path)
    client, backend = engine_client(model)
    a, b = {LEASE_HEADER: "run-a-0001"}, {LEASE_HEADER: "run-b-0001"}
    adapter = make_adapter(tmp_path, "v1")
    async with client:
        refused = await client.post("/policy/publish", json=publish_body(1, adapter))
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "no_lease"
        first = await client.post("/engine/attach", json=attach_body("run-a-0001", model))
        assert first.status_code == 200 and first.json()["new_run"] is True
        assert (
            await client.post("/policy/publish", json=publish_body(1, adapter), headers=a)
        ).status_code == 200
        sampled = await client.post(
            "/generate", json={"prompt": {"prompt_token_ids": [3, 4]}, "max_tokens": 2}
        )
        assert sampled.status_code == 200
        seq = [3, 4, 1, 0]  # the scripted sampler answers [version, index]
        assert (await client.post("/policy/lookup", json={"sequences": [seq]})).json()["versions"] == [1]
        held = await client.post("/engine/attach", json=attach_body("run-b-0001", model))
        assert held.status_code == 409 and held.json()["error"]["type"] == "lease_held"
        assert "the run run-a-0001" in held.json()["error"]["message"] and held.headers["Retry-After"]
        released = await client.post("/engine/release", json={"holder": "run-a-0001"})
        assert released.json() == {"released": True}
        second = await client.post("/engine/attach", json=attach_body("run-b-0001", model))
        assert second.status_code == 200 and second.json()["new_run"] is True
        assert second.json()["unloaded"] == ["policy-v1"] and backend.unloaded == ["policy-v1"]
        status = (await client.get("/policy")).json()
        assert status["current_version"] == 0 and status["loaded_versions"] == [0]
        looked = await client.post("/policy/lookup", json={"sequences": [seq]})
        assert looked.json()["versions"] == [None]  # the first run's samples are not the second's
        # The old run can no longer steer the engine; the new one's versions have names of their own.
        assert (
            await client.post("/policy/publish", json=publish_body(1, adapter), headers=a)
        ).status_code == 409
        again = await client.post("/policy/publish", json=publish_body(1, adapter), headers=b)
        assert again.status_code == 200 and again.json()["lora_name"] == "policy-r1-v1"
        expect = await client.post("/policy/expect", json={"version": 2, "hold_s": 5}, headers=a)
        assert expect.status_code == 409
        engine = (await client.get("/engine")).json()
        assert engine["runs"] == 2 and engine["lease"]["who"] == "the run run-b-0001"
        anonymous = (await client.get("/engine", headers={"Authorization": ""})).json()
        assert anonymous["lease"] is None  # who holds it: for the token's holders only


async def test_the_engine_refuses_another_model_a_wider_window_and_strangers(tmp_path):
    model, other = fake_model(tmp_path, 8), fake_model(tmp_path, 16)
    client, _ = engine_client(model)
    async with client:
        wrong = await client.post("/engine/attach", json=attach_body("run-a-0001", other))
        err = wrong.json()["error"]
        assert wrong.status_code == 409 and err["type"] == "model_mismatch"
        assert str(model) in err["message"] and str(other) in err["message"]
        wide = await client.post("/engine/attach", json=attach_body("run-a-0001", model, max_staleness=3))
        assert wide.status_code == 409 and wide.json()["error"]["type"] == "engine_too_small"
        stranger = await client.post(
            "/engine/attach", json=attach_body("run-a-0001", model), headers={"Authorization": "Bearer nope"}
        )
        assert stranger.status_code == 401


async def test_a_run_that_stops_renewing_loses_the_engine_to_the_next(tmp_path):
    model = fake_model(tmp_path)
    client, _ = engine_client(model, ttl_s=0.3)
    async with client:
        assert (await client.post("/engine/attach", json=attach_body("run-a-0001", model))).status_code == 200
        assert (await client.post("/engine/attach", json=attach_body("run-b-0001", model))).status_code == 409
        await asyncio.sleep(0.4)
        assert (await client.post("/engine/attach", json=attach_body("run-b-0001", model))).status_code == 200
        renew = await client.post("/engine/renew", json={"holder": "run-a-0001"})
        assert renew.status_code == 409 and "run-b-0001" in renew.json()["error"]["message"]
        assert (await client.get("/engine")).json()["lapsed"] == 1


async def test_a_runs_own_gateway_is_no_engine(tmp_path):
    backend = ScriptedBackend()
    cfg = GatewayConfig(model="m", vllm={"max_lora_rank": 8})
    app = create_app(cfg, backend, PolicyRegistry("base", 1), vocab_size=100, start_backend=False)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as client:
        assert (await client.get("/engine")).status_code == 404
        adapter = make_adapter(tmp_path, "v1")
        assert (await client.post("/policy/publish", json=publish_body(1, adapter))).status_code == 200


def test_an_attached_runs_keys_stay_out_of_the_gateway_config_and_its_lease_goes_with_its_calls(
    tiny_model_path,
):
    cfg = RunConfig.model_validate(
        {"model": {"path": str(tiny_model_path)}, "inference": {"engine_url": "http://127.0.0.1:1"}}
    )
    cfg.inference["engine_lease"] = "run-a-0001"
    section = gateway_section(cfg, str(tiny_model_path))
    assert not set(ATTACH_KEYS) & set(section)
    assert lease_headers(cfg) == {LEASE_HEADER: "run-a-0001"}
    cfg.inference.pop("engine_url")
    assert lease_headers(cfg) == {}


def test_a_run_asking_for_other_vllm_settings_than_the_engine_runs_is_told_which():
    served = {"dtype": "float32", "max_lora_rank": 8, "extra_args": [], "startup_timeout_s": 300.0}
    same = {"dtype": "auto", "max_lora_rank": 8, "startup_timeout_s": 60.0, "api_key": "k"}
    assert vllm_differences(same, served) == []
    other = {"dtype": "bfloat16", "extra_args": ["--enable-auto-tool-choice"], "max_lora_rank": 8}
    assert vllm_differences(other, served) == [
        "inference.vllm.dtype: the run's 'bfloat16', the engine's 'float32'",
        "inference.vllm.extra_args: the run's ['--enable-auto-tool-choice'], the engine's []",
    ]
