"""The token-in routes (inference/http/tokenize_chat.py) against a scripted sampler: /tokenize goes to vLLM's /tokenize on
the base model and is never recorded; /v1/chat/completions/tokens samples the given ids through /v1/completions,
answers a chat completion with the ids and chat logprobs, and records prompt + sampled ids in the ledger. Hostile
bodies get a 400 naming the field and never reach the sampler."""

from __future__ import annotations

from typing import Any

import pytest

from inference.http.tokenize_chat import chat_answer, chat_logprobs, completions_body
from tests.scripted_gateway import ScriptedBackend, client_for


class RecordingBackend(ScriptedBackend):
    """Answers /tokenize and /v1/completions as vLLM does (return_token_ids: prompt and sampled ids per choice)."""

    def __init__(self) -> None:
        super().__init__()
        self.forwarded: list[tuple[str, dict[str, Any], str]] = []

    async def forward(self, path: str, body: dict[str, Any], policy: Any) -> dict[str, Any]:
        self.forwarded.append((path, body, policy.model_name))
        if path == "/tokenize":
            return {"count": 3, "max_model_len": 64, "tokens": [5, 6, 7], "token_strs": None}
        return {
            "id": "cmpl-abc",
            "object": "text_completion",
            "created": 1,
            "model": policy.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": "hi!",
                    "logprobs": {
                        "tokens": ["hi", "!"],
                        "token_logprobs": [-0.5, -1.25],
                        "top_logprobs": [{"hi": -0.5}, {"!": -1.25}],
                        "text_offset": [0, 2],
                    },
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_token_ids": list(body["prompt"]),
                    "token_ids": [11, 12],
                }
            ],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2, "total_tokens": 0},
        }


CHAT_TOKENS = {
    "model": "whatever",
    "messages": [{"role": "user", "content": "Go on."}],
    "tools": None,
    "tokens": [1, 2, 3, 4],
    "temperature": 1.0,
    "n": 1,
    "max_completion_tokens": 2,
    "logprobs": True,
    "return_token_ids": True,
}


async def test_tokens_chat_samples_the_given_ids_and_records_them_in_the_ledger():
    backend = RecordingBackend()
    client, registry = client_for(backend)
    async with client:
        r = await client.post("/v1/chat/completions/tokens", json=CHAT_TOKENS)
        assert r.status_code == 200, r.text
        answer = r.json()
        path, sent, model = backend.forwarded[-1]
        assert (path, model) == ("/v1/completions", registry.current.model_name)
        # the ids are the prompt; the chat-only keys are gone; the chat's logprobs=true is "the sampled token's"
        assert sent == {
            "prompt": [1, 2, 3, 4],
            "temperature": 1.0,
            "n": 1,
            "max_tokens": 2,
            "logprobs": 0,
            "return_token_ids": True,
        }
        assert answer["object"] == "chat.completion" and answer["policy_version"] == 0
        assert r.headers["X-Policy-Version"] == "0"
        assert answer["prompt_token_ids"] == [1, 2, 3, 4]
        choice = answer["choices"][0]
        assert choice["token_ids"] == [11, 12]
        assert choice["message"] == {"role": "assistant", "content": "hi!", "tool_calls": []}
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.5, -1.25]
        lookup = await client.post(
            "/policy/lookup", json={"sequences": [[1, 2, 3, 4, 11, 12], [1, 2, 3, 4, 11]]}
        )
        assert lookup.json()["versions"] == [0, None]


async def test_tokenize_is_forwarded_on_the_base_model_and_never_recorded():
    backend = RecordingBackend()
    client, registry = client_for(backend)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": None}
    async with client:
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [5, 6, 7]
        path, sent, model = backend.forwarded[-1]
        assert (path, model) == ("/tokenize", registry.base.model_name)
        assert sent["messages"] == body["messages"]
        lookup = await client.post("/policy/lookup", json={"sequences": [[5, 6, 7]]})
        assert lookup.json()["versions"] == [None]
        r = await client.post("/tokenize", json={"prompt": "World!", "add_special_tokens": False})
        assert r.status_code == 200, r.text


def test_a_chat_without_a_length_limit_may_use_the_rest_of_the_context():
    assert "max_tokens" not in completions_body({"tokens": [1, 2]})
    assert completions_body({"tokens": [1], "max_tokens": 3})["max_tokens"] == 3
    assert completions_body({"tokens": [1], "logprobs": True, "top_logprobs": 2})["logprobs"] == 2
    assert "logprobs" not in completions_body({"tokens": [1], "logprobs": False})
    # tools with tool_choice none only shaped the rendering the ids replace
    completions_body({"tokens": [1], "tools": [{"type": "function"}], "tool_choice": "none"})


async def test_no_limit_becomes_the_rest_of_the_context():
    backend = RecordingBackend()
    client, _ = client_for(backend)  # the scripted model's context is 64 tokens
    async with client:
        r = await client.post("/v1/chat/completions/tokens", json={"tokens": [1, 2, 3]})
        assert r.status_code == 200, r.text
        assert backend.forwarded[-1][1]["max_tokens"] == 61


def test_chat_logprobs_keep_one_entry_per_sampled_token():
    assert chat_logprobs(None) is None
    out = chat_logprobs({"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": None})
    assert out == {
        "content": [
            {"token": "a", "logprob": -1.0, "bytes": None, "top_logprobs": []},
            {"token": "b", "logprob": -2.0, "bytes": None, "top_logprobs": []},
        ]
    }
    with pytest.raises(ValueError):  # a sampler answer whose lists disagree is not reshaped silently
        chat_logprobs({"tokens": ["a"], "token_logprobs": [-1.0, -2.0]})
    answer = chat_answer({"id": "cmpl-x", "choices": []}, [1])
    assert answer["id"] == "chatcmpl-x" and answer["prompt_token_ids"] == [1]


# (route, body, what the 400's message must name)
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("/tokenize", {}, "exactly one"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt must be a text"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": ["hi"]}, "messages[0]"),
    ("/tokenize", {"prompt": "a", "tools": "all"}, "tools"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "chat_template": "{{ 7*7 }}"}, "chat_template"),
    ("/v1/chat/completions/tokens", {"messages": [{"role": "user", "content": "x"}]}, "tokens"),
    ("/v1/chat/completions/tokens", {"tokens": []}, "tokens"),
    ("/v1/chat/completions/tokens", {"tokens": [1, "a"]}, "tokens.1"),
    ("/v1/chat/completions/tokens", {"tokens": [1, -3]}, "tokens.1"),
    ("/v1/chat/completions/tokens", {"tokens": [1, 100]}, "outside the vocabulary"),
    ("/v1/chat/completions/tokens", {"tokens": [1] * 65}, "context"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "max_tokens": 1e9}, "max_tokens"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "temperature": -1}, "temperature"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "logprobs": 5}, "logprobs"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "logprobs": True, "top_logprobs": 99}, "logprobs"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "stream": True}, "stream"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "echo": True}, "echo"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "prompt": [2]}, "prompt"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "messages": "hi"}, "messages"),
    ("/v1/chat/completions/tokens", {"tokens": [1], "tools": [{"type": "function"}]}, "tool calls"),
]


@pytest.mark.parametrize("route,body,needle", HOSTILE, ids=[f"{r}-{i}" for i, (r, *_) in enumerate(HOSTILE)])
async def test_hostile_token_bodies_get_a_400_naming_the_field(route, body, needle):
    backend = RecordingBackend()
    client, _ = client_for(backend)
    async with client:
        r = await client.post(route, json=body)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert needle in message, message
        assert not backend.forwarded, "a refused request reached the sampler"


async def test_the_tinker_sampler_refuses_the_token_routes_with_501():
    pytest.importorskip("tinker")
    from inference.config import GatewayConfig
    from inference.samplers.tinker import TinkerSamplingBackend

    backend = TinkerSamplingBackend(GatewayConfig(model="m"), "tiny", None, lambda: None, timeout_s=1)
    client, _ = client_for(backend)  # type: ignore[arg-type]
    async with client:
        for route, body in (("/tokenize", {"prompt": "a"}), ("/v1/chat/completions/tokens", {"tokens": [1]})):
            r = await client.post(route, json=body)
            assert r.status_code == 501, r.text
            assert "Tinker" in r.json()["error"]["message"]
