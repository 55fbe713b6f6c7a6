"""Large bodies never stall the gateway (parsed and validated off the event loop, in steps), and answers on a
kept-alive connection carry no delayed-ACK floor. The gateway runs as `python -m inference` runs it: on the
socket inference.__main__.listening_socket makes (or inherits), under uvicorn on the stdlib asyncio loop."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import statistics
import time
from typing import Any

import httpx
import pytest

from inference.__main__ import listening_socket
from inference.app import create_app
from inference.config import GatewayConfig
from inference.http import incremental_json
from inference.policy.registry import PolicyRegistry
from tests.helpers import serve_app
from tests.scripted_gateway import ScriptedBackend, client_for
from tests.unit.test_gateway_hostile import find_unsafe_value, json_depth

KEPT_ALIVE_MEDIAN_S = 0.010  # loose for a loaded 2-core box; the delayed-ACK floor was 40-44 ms


def gateway(sock: socket.socket) -> contextlib.AbstractContextManager[str]:
    """The app over `sock`, served as inference.__main__.serve serves it (uvloop, which `uvicorn.run` would pick,
    sets TCP_NODELAY itself: the stdlib loop is the one that needs the socket's protocol)."""
    app = create_app(
        GatewayConfig(model="m"),
        ScriptedBackend(),
        PolicyRegistry("base", 3),
        vocab_size=1000,
        start_backend=False,
    )
    return serve_app(app, sock)


def bound_here() -> socket.socket:
    return listening_socket(GatewayConfig(model="m", port=0), None)


def inherited() -> socket.socket:
    """What the launcher hands over with --fd: a socket it bound (the plain way), by its descriptor."""
    launcher = socket.socket()
    launcher.bind(("127.0.0.1", 0))
    launcher.listen(16)
    try:
        return listening_socket(GatewayConfig(model="m"), launcher.dup().detach())
    finally:
        launcher.close()


# --- no latency floor on a kept-alive connection ----------------------------------------------------------------


@pytest.mark.parametrize("make_socket", [bound_here, inherited], ids=["bound", "inherited-fd"])
def test_a_kept_alive_connection_answers_without_a_delayed_ack_floor(make_socket):
    """Issue 30: every answer but a connection's first took >= 44 ms (Nagle's algorithm on the gateway's
    connections met the client's delayed ACK); a fresh connection took 0.7 ms."""
    with gateway(make_socket()) as url, httpx.Client(base_url=url, timeout=10) as client:
        client.get("/health")  # the connection's first answer never waits
        latencies = []
        for _ in range(50):
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
        posts = []
        for _ in range(10):  # a POST's answer too (a body is read and parsed first)
            started = time.perf_counter()
            assert client.post("/policy/lookup", json={"sequences": [[1, 2]]}).status_code == 200
            posts.append(time.perf_counter() - started)
    median, post_median = statistics.median(latencies), statistics.median(posts)
    print(f"\nkept-alive /health median {median * 1e3:.2f} ms, POST median {post_median * 1e3:.2f} ms")
    assert median <= KEPT_ALIVE_MEDIAN_S and post_median <= KEPT_ALIVE_MEDIAN_S, (median, post_median)


def test_the_gateway_socket_says_tcp():
    """asyncio sets TCP_NODELAY on accepted connections only when the listening socket's proto is IPPROTO_TCP."""
    for make in (bound_here, inherited):
        sock = make()
        try:
            assert sock.proto == socket.IPPROTO_TCP
        finally:
            sock.close()


# --- maximal bodies off the event loop --------------------------------------------------------------------------


# --- the stepwise parser ----------------------------------------------------------------------------------------


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 5 else 5)
    if kind == 0:
        return rng.randrange(-(10**6), 10**6)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 5)
    if kind == 2:  # strings holding what the parser cuts at, escapes and a surrogate pair
        return "".join(rng.choice('a,][{}":\\\n\té\U0001f600 u') for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind in (5, 6, 7):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(30 if kind == 7 else 6))]
    if kind == 8:
        return {
            f"k{rng.randrange(99)}{random_value(rng, 5)!s:.5}": random_value(rng, depth + 1) for _ in range(5)
        }
    return rng.randrange(200_000)


def damaged(rng: random.Random, raw: bytes) -> bytes:
    """`raw` cut short, or with one byte replaced by one that matters to a JSON parser."""
    where = rng.randrange(len(raw))
    if rng.random() < 0.5:
        return raw[:where]
    return raw[:where] + rng.choice(b'[]{}",:\\0e-').to_bytes(1, "big") + raw[where + 1 :]


@pytest.mark.parametrize("step", [16, 33, 1 << 16])
def test_the_stepwise_parser_gives_what_json_loads_gives(monkeypatch, step):
    """On random documents in every layout (the small steps cut values, strings and escapes everywhere), and on
    the same documents damaged: both parsers accept or refuse each alike."""
    monkeypatch.setattr(incremental_json, "STEP", step)
    rng = random.Random(step)
    for _ in range(150):
        value = random_value(rng)
        for layout in ({}, {"ensure_ascii": False}, {"separators": (",", ":")}, {"indent": 1}):
            raw = json.dumps(value, **layout).encode()
            assert json.dumps(incremental_json.parse(raw, 64)) == json.dumps(json.loads(raw))  # key order too
        for _ in range(3):
            bad = damaged(rng, json.dumps(value).encode())
            try:
                expected = json.loads(bad)
            except ValueError:
                with pytest.raises(ValueError):  # TooDeep and Unsafe are ValueErrors too
                    incremental_json.parse(bad, 64)
                continue
            if json_depth(bad) > 64 or find_unsafe_value(expected) is not None:
                with pytest.raises((incremental_json.TooDeep, incremental_json.Unsafe)):
                    incremental_json.parse(bad, 64)
            else:
                assert incremental_json.parse(bad, 64) == expected


@pytest.mark.parametrize("step", [16, 1 << 16])
def test_the_parser_refuses_what_the_routes_must_never_see_naming_the_field(monkeypatch, step):
    monkeypatch.setattr(incremental_json, "STEP", step)
    long_ids = ", ".join(["7"] * 500)
    cases = [
        (b'{"a": [1, {"b": NaN}]}', incremental_json.Unsafe, "a[1].b: nan is not a finite number"),
        (
            f'{{"ids": [{long_ids}, 1e400]}}'.encode(),
            incremental_json.Unsafe,
            "ids[500]: inf is not a finite number",
        ),
        (f'{{"ids": [{long_ids}, -Infinity]}}'.encode(), incremental_json.Unsafe, "ids[500]: -inf"),
        (b'{"s": ["ok", "\\udfff x"]}', incremental_json.Unsafe, "s[1]: the string is not valid Unicode"),
        (b'{"s": {"\\ud800": 1}}', incremental_json.Unsafe, "s: a key is not valid Unicode"),
        (
            '{"s": "\ud800"}'.encode("utf-8", "surrogatepass"),
            incremental_json.Unsafe,
            "s: the string is not valid",
        ),
        (b"[" * 65 + b"]" * 65, incremental_json.TooDeep, "nested deeper than 64 levels"),
        (b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}", incremental_json.TooDeep, "nested deeper than 64 levels"),
        (b'{"n": 1' + b"0" * 5000 + b"}", ValueError, "longer than 4300"),
        (b'{"a": "unterminated', ValueError, "Unterminated string"),
        (b'{"a": [1, 2,]}', ValueError, "Expecting value"),
    ]
    for raw, error, needle in cases:
        with pytest.raises(error) as err:
            incremental_json.parse(raw, 64)
        assert needle in str(err.value), (raw[:60], str(err.value))
    assert incremental_json.parse(b"[" * 64 + b"]" * 64, 64) is not None
    assert incremental_json.parse('{"pair": "\\ud83d\\ude00 \U0001f600"}'.encode(), 64) == {
        "pair": "\U0001f600 \U0001f600"
    }


def test_too_many_containers_members_or_characters_are_refused(monkeypatch):
    monkeypatch.setattr(incremental_json, "MAX_CONTAINERS", 1000)
    monkeypatch.setattr(incremental_json, "MAX_MEMBERS", 1000)
    monkeypatch.setattr(
        incremental_json, "STEP", 256
    )  # a body of many steps, as a real one past these limits is
    assert len(incremental_json.parse(json.dumps([[1]] * 999).encode(), 64)) == 999
    with pytest.raises(incremental_json.TooBig, match="more than 1000 JSON arrays and objects"):
        incremental_json.parse(json.dumps([[1]] * 1000).encode(), 64)
    with pytest.raises(incremental_json.TooBig, match="more than 1000 members"):
        incremental_json.parse(json.dumps({str(i): 0 for i in range(1001)}).encode(), 64)
    monkeypatch.setattr(incremental_json, "MAX_STRING_CHARS", 1000)
    assert (
        len(incremental_json.parse(json.dumps({"s": "é" * 999}, ensure_ascii=False).encode(), 64)["s"]) == 999
    )
    with pytest.raises(incremental_json.TooBig, match="s: a string longer than 1000 characters"):
        incremental_json.parse(json.dumps({"s": "é" * 1300}, ensure_ascii=False).encode(), 64)


def test_a_parsed_body_is_freed_but_never_a_list_still_in_use():
    freed: list[bool] = []

    class Probe:
        def __del__(self) -> None:
            freed.append(True)

    shared = list(range(70_000))  # something else holds this one (as a route that kept a list would)
    box = [{"sequences": [shared, [*range(70_000), Probe()]], "x": {"y": [1.5] * 70_000}}]
    incremental_json.dispose(box)
    assert box == [] and freed == [True]
    assert shared == list(range(70_000)), "a list something else holds was emptied"


# --- the routes validate large bodies in bounded steps ----------------------------------------------------------


async def test_large_bodies_are_validated_with_messages_naming_the_entry():
    client, _ = client_for(ScriptedBackend())
    async with client:
        seqs = [[5] * 70_000, [1, 2] * 40_000 + [-1]]
        r = await client.post("/policy/lookup", json={"sequences": seqs})
        assert r.status_code == 400 and "sequences.1.80000" in r.json()["error"]["message"], r.text
        r = await client.post("/policy/lookup", json={"sequences": [[5] * 70_000], "extra": 1})
        assert r.status_code == 400 and "extra" in r.json()["error"]["message"], r.text
        r = await client.post("/policy/lookup", json={"sequences": [[5] * 70_000, [7] * 3]})
        assert r.status_code == 200 and r.json() == {"versions": [None, None]}
        long_prompt = {"prompt": {"prompt_token_ids": [1] * 100_000}, "max_tokens": 2}
        r = await client.post("/generate", json=long_prompt)
        assert r.status_code == 400 and r.json()["error"]["type"] == "prompt_too_long", r.text
        assert "prompt.prompt_token_ids: 100000 tokens, more than the model's context of 64" in r.text
        many_stops = {"prompt": {"prompt_token_ids": [1]}, "stop_token_ids": [1] * 300_000}
        r = await client.post("/generate", json=many_stops)
        assert r.status_code == 400 and "stop_token_ids: 300000 entries" in r.text, r.text
        r = await client.post("/v1/completions", json={"prompt": [[1] * 100_000], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["type"] == "prompt_too_long", r.text
        nan_deep = b'{"prompt": {"prompt_token_ids": [' + b"1, " * 20_000 + b'1]}, "top_p": NaN}'
        r = await client.post("/generate", content=nan_deep)
        assert r.status_code == 400 and "top_p: nan is not a finite number" in r.text, r.text
        ok = await client.post("/generate", json={"prompt": {"prompt_token_ids": [1] * 40}, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
