"""The token-in generate route verifiers v1 calls (inference/http/token_in_generate.py) against a scripted sampler: the body
renderers' generate() posts is sampled under the current policy, answered in vLLM's token-in shape with each logprob
entry naming its token as renderers reads it, and recorded in the version ledger; hostile bodies get a 400 naming
the field and never reach the sampler."""

from __future__ import annotations

from typing import Any

import pytest

from inference.errors import BackendError
from inference.http.token_in_generate import check_sampled, checked_tokenin
from inference.policy.registry import Policy
from inference.wire import Sample, SamplingRequest
from tests.scripted_gateway import ScriptedBackend, client_for

# What renderers 0.1.12's generate() posts for a verifiers v1 TrainClient turn (read from its source).
RENDERERS_BODY: dict[str, Any] = {
    "model": "whatever",
    "token_ids": [3, 20, 21, 4, 3, 22],
    "sampling_params": {
        "temperature": 1.0,
        "max_tokens": 2,
        "stop_token_ids": [2],
        "logprobs": 1,
        "skip_special_tokens": False,
    },
}


class RecordingBackend(ScriptedBackend):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[SamplingRequest] = []

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        self.requests.append(req)
        return await super().sample(req, policy)


def renderers_logprobs(choice: dict[str, Any]) -> list[float]:
    """What renderers' _parse_completion_logprobs accepts: one entry per sampled id, `token` "token_id:<id>"."""
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    for entry, token in zip(content, choice["token_ids"], strict=True):
        assert entry["token"] == f"token_id:{token}" and entry["token_id"] == token
    return [float(e["logprob"]) for e in content]


async def test_the_renderers_body_is_sampled_answered_and_recorded():
    backend = RecordingBackend()
    client, _ = client_for(backend)
    async with client:
        r = await client.post("/inference/v1/generate", json=RENDERERS_BODY)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert r.headers["X-Policy-Version"] == "0" and answer["policy_version"] == 0
        req = backend.requests[-1]
        assert req.prompt_token_ids == [3, 20, 21, 4, 3, 22] and req.n == 1 and req.max_tokens == 2
        # logprobs is answered by the route itself and no text is answered: the sampler gets what changes the ids
        assert req.sampling == {"temperature": 1.0, "stop_token_ids": [2]}
        assert answer["prompt_token_ids"] == RENDERERS_BODY["token_ids"]
        (choice,) = answer["choices"]
        assert choice["token_ids"] == [0, 0] and choice["finish_reason"] == "length"
        assert renderers_logprobs(choice) == [-0.1, -0.2]
        assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
        lookup = await client.post(
            "/policy/lookup", json={"sequences": [[3, 20, 21, 4, 3, 22, 0, 0], [3, 20, 21, 4, 3, 22, 0]]}
        )
        assert lookup.json()["versions"] == [0, None]


async def test_n_samples_and_the_request_id_come_back():
    backend = RecordingBackend()
    client, _ = client_for(backend)
    body = {**RENDERERS_BODY, "request_id": "r-1", "sampling_params": {"n": 3, "max_tokens": 4}}
    async with client:
        r = await client.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["request_id"] == "r-1"
        assert [c["token_ids"] for c in answer["choices"]] == [[0, 0], [0, 1], [0, 2]]
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2]


async def test_no_length_limit_is_the_rest_of_the_context_and_integer_stops_become_stop_ids():
    backend = RecordingBackend()
    client, _ = client_for(backend)  # the scripted model's context is 64 tokens
    async with client:
        body = {"token_ids": [1, 2, 3], "sampling_params": {"stop": ["x", 7]}}
        r = await client.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        req = backend.requests[-1]
        assert req.max_tokens == 61
        assert req.sampling == {"stop": ["x"], "stop_token_ids": [7]}


HOSTILE: list[tuple[dict[str, Any] | bytes, str]] = [
    ({**RENDERERS_BODY, "features": {"mm_hashes": {}}}, "features"),
    ({**RENDERERS_BODY, "content_parts": [{"type": "image_url", "url": "x"}]}, "content_parts"),
    ({**RENDERERS_BODY, "stream": True}, "stream"),
    ({**RENDERERS_BODY, "output_mode": "text"}, "output_mode"),
    ({**RENDERERS_BODY, "priority": 3}, "priority"),
    ({**RENDERERS_BODY, "frobnicate": 1}, "frobnicate"),
    ({**RENDERERS_BODY, "cache_salt": ""}, "cache_salt"),
    ({**RENDERERS_BODY, "token_ids": []}, "token_ids"),
    ({**RENDERERS_BODY, "token_ids": [1, 100]}, "outside the vocabulary"),
    ({**RENDERERS_BODY, "token_ids": [1, -1]}, "token_ids"),
    ({**RENDERERS_BODY, "token_ids": [1, True]}, "token_ids"),
    ({**RENDERERS_BODY, "token_ids": list(range(65))}, "context"),
    ({**RENDERERS_BODY, "token_ids": [1] * 60, "sampling_params": {"max_tokens": 10}}, "context"),
    ({**RENDERERS_BODY, "sampling_params": [1]}, "sampling_params"),
    ({**RENDERERS_BODY, "sampling_params": {"logprobs": 5}}, "sampling_params.logprobs"),
    ({**RENDERERS_BODY, "sampling_params": {"logprobs": True}}, "sampling_params.logprobs"),
    ({**RENDERERS_BODY, "sampling_params": {"prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
    ({**RENDERERS_BODY, "sampling_params": {"guided_json": {}}}, "guided_json"),
    ({**RENDERERS_BODY, "sampling_params": {"max_tokens": "abc"}}, "max_tokens"),
    ({**RENDERERS_BODY, "sampling_params": {"n": 0}}, "n"),
    ({**RENDERERS_BODY, "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({**RENDERERS_BODY, "sampling_params": {"stop": [1.5]}}, "sampling_params.stop[0]"),
    ({**RENDERERS_BODY, "sampling_params": {"stop_token_ids": list(range(300_000))}}, "stop_token_ids"),
    (b'{"token_ids": [1], "sampling_params": {"temperature": NaN}}', "temperature"),
    (b'{"token_ids": [1], "sampling_params": {"seed": 1e400}}', "seed"),
    (b'{"token_ids": [1, 1180591620717411303424]}', "token_ids"),
    (b"[1, 2]", "JSON object"),
]


@pytest.mark.parametrize(("body", "needle"), HOSTILE)
async def test_hostile_bodies_are_refused_naming_the_field_and_never_sampled(body: Any, needle: str):
    backend = RecordingBackend()
    client, _ = client_for(backend)
    async with client:
        if isinstance(body, bytes):
            r = await client.post(
                "/inference/v1/generate", content=body, headers={"content-type": "application/json"}
            )
        else:
            r = await client.post("/inference/v1/generate", json=body)
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
        assert backend.requests == []


def test_a_missing_limit_without_a_known_context_is_refused():
    backend = ScriptedBackend()
    backend.max_model_len = None

    class Model:
        def __init__(self) -> None:
            self.backend = backend

        def validate_tokens(self, ids: list[int], max_tokens: int, field: str) -> None: ...
        def note_moved_stop_ids(self, route: str, ids: list[int]) -> None: ...

    with pytest.raises(BackendError, match=r"max_tokens: required"):
        checked_tokenin(Model(), {"token_ids": [1]})
    req, moved = checked_tokenin(Model(), {"token_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert req.sampling.max_tokens == 3 and moved == [] and req.request_id


@pytest.mark.parametrize(
    ("sample", "needle"),
    [
        (Sample(token_ids=[1, 2], logprobs=[-0.1], finish_reason="stop"), "2 ids but 1 logprobs"),
        (Sample(token_ids=[1], logprobs=[float("nan")], finish_reason="stop"), "nan"),
        (Sample(token_ids=[1], logprobs=[0.5], finish_reason="stop"), "0.5"),
    ],
)
def test_a_sampler_answer_that_renderers_would_misread_is_a_502(sample: Sample, needle: str):
    with pytest.raises(BackendError, match=needle) as info:
        check_sampled([Sample(token_ids=[1], logprobs=[-1.0], finish_reason="stop"), sample])
    assert info.value.status == 502
    check_sampled([Sample(token_ids=[1], logprobs=[-9999.0], finish_reason="length")])  # finite: passed on


def test_the_renderers_body_is_one_the_tinker_sampler_takes():
    """The Tinker sampler refuses every key it does not know; renderers' body leaves it only what it takes."""
    from inference.samplers.tinker import SUPPORTED_KEYS

    class Model:
        backend = ScriptedBackend()

        def validate_tokens(self, ids: list[int], max_tokens: int, field: str) -> None: ...
        def note_moved_stop_ids(self, route: str, ids: list[int]) -> None: ...

    req, _ = checked_tokenin(Model(), dict(RENDERERS_BODY))
    assert set(req.sampling.sampling) <= SUPPORTED_KEYS


async def test_an_evaluation_samples_its_target_outside_the_ledger():
    backend = RecordingBackend()
    client, _ = client_for(backend)
    async with client:
        r = await client.post("/eval/base/inference/v1/generate", json=RENDERERS_BODY)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert r.headers["X-Eval-Target"] == "base" and answer["eval_target"] == "base"
        assert "policy_version" not in answer
        assert renderers_logprobs(answer["choices"][0]) == [-0.1, -0.2]
        lookup = await client.post("/policy/lookup", json={"sequences": [[3, 20, 21, 4, 3, 22, 0, 0]]})
        assert lookup.json()["versions"] == [None]  # no trainer trains on an evaluation's samples
        r = await client.post("/eval/nope/inference/v1/generate", json=RENDERERS_BODY)
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        r = await client.post("/eval/base/inference/v1/generate", json={**RENDERERS_BODY, "stream": True})
        assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    assert len(backend.requests) == 1
