"""The evaluation routes (/eval/{target}/..., inference/http/evalroutes.py) against a scripted sampler: the answers
/generate and the OpenAI routes give, on the base model or a named adapter, without the on-policy gate, its quota or
the version ledger; and the named-adapter rules they lean on (the reserved name, unloads, LoRA slots)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from inference.app import create_app
from inference.config import GatewayConfig
from inference.policy.registry import Policy, PolicyRegistry
from inference.samplers.vllm_command import build_vllm_command
from inference.wire import Sample, SamplingRequest
from tests.scripted_gateway import ScriptedBackend, client_for, make_adapter, publish_body

GEN = {"prompt": {"prompt_token_ids": [1, 2]}, "n": 2, "max_tokens": 3}
SGLANG = {"input_ids": [1, 2], "sampling_params": {"n": 2, "max_new_tokens": 3}}
CHAT = {"model": "anything", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TARGET = "eval-step-2"
SETTLE_S = 0.1  # long enough for a request to reach the sampler or the gate in-process


class RecordingBackend(ScriptedBackend):
    """ScriptedBackend whose OpenAI calls, like its samples, wait for `gate`; records each call's kind and body, and
    answers prompt logprobs when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.forwarded: list[tuple[str, dict[str, Any], str]] = []
        self.running: list[str] = []

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        scoring = req.sampling.get("prompt_logprobs") is not None
        self.running.append("score" if scoring else "sample")
        try:
            samples = await super().sample(req, policy)
        finally:
            self.running.remove("score" if scoring else "sample")
        if scoring:
            return [s.model_copy(update={"prompt_logprobs": [None, {2: -0.5}]}) for s in samples]
        return samples

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        self.forwarded.append((path, body, policy.model_name))
        kind = "score" if body.get("echo") or body.get("prompt_logprobs") is not None else "sample"
        self.running.append(kind)
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.running.remove(kind)
        return await super().forward(path, body, policy)


async def load(client: Any, tmp_path: Any, name: str = TARGET) -> None:
    r = await client.post("/adapters/load", json={"name": name, "adapter_path": make_adapter(tmp_path, name)})
    assert r.status_code == 200, r.text


async def test_eval_routes_answer_what_the_policy_routes_do_on_base_and_on_a_named_adapter(tmp_path):
    backend = RecordingBackend()
    client, reg = client_for(backend)
    async with client:
        await load(client, tmp_path)
        policy_answer = (await client.post("/generate", json=GEN)).json()
        policy_sglang = (await client.post("/generate", json=SGLANG)).json()
        for target, first_token in (("base", 0), (TARGET, -1)):
            r = await client.post(f"/eval/{target}/generate", json=GEN)
            assert r.status_code == 200 and r.headers["x-eval-target"] == target
            assert "x-policy-version" not in r.headers and "policy_version" not in r.json()
            assert r.json()["token_ids"] == [[first_token, 0], [first_token, 1]]
            if (
                target == "base"
            ):  # the base model is version 0: the same samples as /generate, less the version
                assert r.json() == {k: v for k, v in policy_answer.items() if k != "policy_version"}
            sglang = (await client.post(f"/eval/{target}/generate", json=SGLANG)).json()
            assert [s["output_ids"][0] for s in sglang] == [first_token, first_token]
            assert all("policy_version" not in s["meta_info"] for s in sglang)
            if target == "base":
                for ours, theirs in zip(sglang, policy_sglang):
                    theirs["meta_info"].pop("policy_version")
                    assert ours == theirs
            for path in ("/v1/completions", "/v1/chat/completions"):
                body = {**CHAT, "stop": [7, "end"]} if "chat" in path else {"prompt": [1, 2], "max_tokens": 3}
                r = await client.post(f"/eval/{target}{path}", json=body)
                assert r.status_code == 200 and r.json()["eval_target"] == target
                assert "policy_version" not in r.json() and r.headers["x-eval-target"] == target
                sent_path, sent, model = backend.forwarded[-1]
                assert (sent_path, model) == (
                    path,
                    reg.base.model_name if target == "base" else f"named-{target}",
                )
                assert sent["return_token_ids"] is True
            assert sent["stop"] == ["end"] and sent["stop_token_ids"] == [7]  # the checks /v1/... makes
            models = (await client.get(f"/eval/{target}/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [target] and models["data"][0]["max_model_len"] == 64
            health = await client.get(f"/eval/{target}/health")
            assert health.status_code == 200 and health.json() == {"status": "ok", "eval_target": target}
        backend.state = "starting"
        assert (await client.get("/eval/base/health")).status_code == 503


async def test_eval_routes_refuse_what_the_policy_routes_refuse_with_the_same_message():
    client, _ = client_for(RecordingBackend())
    bad = [
        ("/generate", {"prompt": {"prompt_token_ids": [1, 100]}, "max_tokens": 3}),  # outside the vocabulary
        ("/generate", {"input_ids": [1], "sampling_params": {"prompt_logprobs": 1}}),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 70}),  # past the context of 64
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}),
    ]
    async with client:
        for path, body in bad:
            ours, theirs = (
                await client.post(f"/eval/base{path}", json=body),
                await client.post(path, json=body),
            )
            assert ours.status_code == theirs.status_code == 400, (path, ours.text)
            assert ours.json() == theirs.json()


async def test_an_unknown_target_is_a_404_that_says_to_load_it(tmp_path):
    client, _ = client_for(RecordingBackend())
    async with client:
        await load(client, tmp_path)
        assert (await client.post("/adapters/unload", json={"name": TARGET})).json()["unloaded"] is True
        for method, path, body in (
            ("GET", "health", None),
            ("POST", "generate", GEN),
            ("POST", "v1/completions", {"prompt": "x"}),
            ("POST", "v1/chat/completions", CHAT),
            ("GET", "v1/models", None),
        ):
            for target in (TARGET, "never-loaded"):
                r = await client.request(method, f"/eval/{target}/{path}", json=body)
                error = r.json()["error"]
                assert r.status_code == 404 and error["type"] == "adapter_not_loaded", (path, r.text)
                assert target in error["message"] and "POST /adapters/load" in error["message"]


async def test_eval_requests_pass_a_closed_gate_leave_its_counters_alone_and_never_reach_the_ledger(tmp_path):
    backend = RecordingBackend()
    client, _ = client_for(backend)
    async with client:
        await load(client, tmp_path)
        await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        held = asyncio.create_task(client.post("/generate", json=GEN))
        await asyncio.sleep(SETTLE_S)
        before = (await client.get("/policy")).json()
        assert before["gate_holding"] == 1 and before["gate_held_total"] == 1
        evals = [
            client.post("/eval/base/generate", json={**GEN, "prompt": {"prompt_token_ids": [3, 4]}}),
            client.post(f"/eval/{TARGET}/generate", json=SGLANG),
            client.post("/eval/base/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}),
            client.post(f"/eval/{TARGET}/v1/chat/completions", json=CHAT),
        ]
        answered = await asyncio.wait_for(asyncio.gather(*evals), timeout=5)
        assert [r.status_code for r in answered] == [200] * 4 and not held.done()
        after = (await client.get("/policy")).json()
        gate_keys = [k for k in after if k.startswith("gate_")]
        assert {k: after[k] for k in gate_keys} == {k: before[k] for k in gate_keys}
        assert after["in_flight"] == {}  # the registry never saw them either
        await client.post("/policy/publish", json=publish_body(1, make_adapter(tmp_path, "v1")))
        assert (await held).headers["x-policy-version"] == "1"
        # Sequences only the eval routes sampled (the scripted OpenAI answer is prompt [1, 2] + [9]) look up as
        # unknown; what /generate sampled is in the ledger.
        lookup = {"sequences": [[3, 4, 0, 0], [3, 4, 0, 1], [1, 2, 9], [1, 2, 1, 0]]}
        assert (await client.post("/policy/lookup", json=lookup)).json()["versions"] == [None, None, None, 1]


async def test_eval_requests_do_not_count_against_the_gate_quota():
    client, _ = client_for(RecordingBackend())
    async with client:
        await client.post("/policy/expect", json={"version": 0, "quota": 2, "refill_s": 30})
        for _ in range(3):  # 6 sequences on the eval routes: three times the quota
            assert (await client.post("/eval/base/generate", json=GEN)).status_code == 200
        assert (await asyncio.wait_for(client.post("/generate", json=GEN), timeout=5)).status_code == 200
        over = asyncio.create_task(
            client.post("/generate", json={**GEN, "n": 1})
        )  # the quota's third sequence
        await asyncio.sleep(SETTLE_S)
        assert not over.done() and (await client.get("/policy")).json()["gate_holding"] == 1
        await client.post("/policy/expect", json={"version": 0})  # a fresh quota lets it through
        assert (await over).status_code == 200


async def test_unload_is_refused_while_an_eval_request_runs_on_the_adapter(tmp_path):
    backend = RecordingBackend()
    backend.gate = asyncio.Event()
    client, _ = client_for(backend)
    async with client:
        await load(client, tmp_path)
        running = [
            asyncio.create_task(client.post(f"/eval/{TARGET}/generate", json=GEN)),
            asyncio.create_task(client.post(f"/eval/{TARGET}/v1/chat/completions", json=CHAT)),
            asyncio.create_task(client.post("/eval/base/generate", json=GEN)),
        ]
        await asyncio.sleep(SETTLE_S)
        refused = await client.post("/adapters/unload", json={"name": TARGET})
        assert refused.status_code == 409 and "2 request(s) running" in refused.json()["error"]["message"]
        backend.gate.set()
        assert [(await t).status_code for t in running] == [200, 200, 200]
        r = await client.post("/adapters/unload", json={"name": TARGET})
        assert r.json() == {"name": TARGET, "unloaded": True} and backend.unloaded == [f"named-{TARGET}"]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
async def test_eval_prompt_scoring_takes_the_solo_lane_where_the_policy_routes_do(platform):
    backend = RecordingBackend()
    backend.gate = asyncio.Event()
    gcfg = GatewayConfig(model="m", vllm={"platform": platform})
    app = create_app(gcfg, backend, PolicyRegistry("base", 1), vocab_size=100, start_backend=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    async with client:
        first = asyncio.create_task(client.post("/eval/base/generate", json=GEN))
        await asyncio.sleep(SETTLE_S)
        scoring = [
            asyncio.create_task(client.post("/eval/base/generate", json={**GEN, "prompt_logprobs": 1})),
            asyncio.create_task(
                client.post("/eval/base/v1/completions", json={"prompt": [1, 2], "echo": True, "logprobs": 1})
            ),
        ]
        await asyncio.sleep(SETTLE_S)
        assert sorted(backend.running) == [
            "sample"
        ]  # alone on every vLLM platform (inference/samplers/solo_lane.py)
        backend.gate.set()
        replies = await asyncio.gather(first, *scoring)
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert replies[1].json()["prompt_logprobs"] == [None, {"2": -0.5}]


async def test_base_is_refused_as_an_adapter_name(tmp_path):
    backend = RecordingBackend()
    client, _ = client_for(backend)
    async with client:
        r = await client.post(
            "/adapters/load", json={"name": "base", "adapter_path": make_adapter(tmp_path, "b")}
        )
        assert r.status_code == 400 and "reserved for the base model" in r.json()["error"]["message"]
    assert backend.loaded == []


def test_named_slots_add_lora_slots_to_the_policy_window():
    window = GatewayConfig(model="m", keep_versions=3)
    both = GatewayConfig(model="m", keep_versions=3, named_slots=2)
    assert (window.max_loras, both.max_loras) == (6, 8)
    argv, _ = build_vllm_command(both, "/m", 1, "k", python="py", serve_cli=True)
    assert argv[argv.index("--max-loras") + 1] == argv[argv.index("--max-cpu-loras") + 1] == "8"
    with pytest.raises(ValidationError, match="named_slots"):
        GatewayConfig(model="m", named_slots=-1)
