"""TF32 for the trainer's fp32 LoRA matmuls: switched on when the model goes to a CUDA device, never on the CPU path
(whose logprobs the CPU recipes compare with vLLM to 1e-5). Runs without CUDA: a CUDA torch.device is just a name
until something is placed on it, and the settings are process-wide flags."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from trainer.backends.local import build_peft_model, use_tf32_on_cuda
from trainer.training.config import RunConfig

pytestmark = pytest.mark.skipif(
    not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9: legacy TF32 flags only"
)


def settings() -> dict[str, str]:
    return {
        "cuda matmul": torch.backends.cuda.matmul.fp32_precision,
        "cudnn conv": torch.backends.cudnn.conv.fp32_precision,
        "cpu (oneDNN) matmul": torch.backends.mkldnn.matmul.fp32_precision,
        "cpu (oneDNN) conv": torch.backends.mkldnn.conv.fp32_precision,
    }


@pytest.fixture
def restored() -> Iterator[dict[str, str]]:
    """The settings before the test; put back afterwards (they are global to the test process)."""
    before = settings()
    yield before
    torch.backends.cuda.matmul.fp32_precision = before["cuda matmul"]
    torch.backends.cudnn.conv.fp32_precision = before["cudnn conv"]
    torch.backends.mkldnn.matmul.fp32_precision = before["cpu (oneDNN) matmul"]
    torch.backends.mkldnn.conv.fp32_precision = before["cpu (oneDNN) conv"]


def cpu_matmul() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 64, generator=g)
    return a @ b


def test_cpu_device_changes_nothing(restored):
    before = cpu_matmul()
    assert use_tf32_on_cuda(torch.device("cpu")) is False
    assert settings() == restored
    assert torch.equal(cpu_matmul(), before)


def test_cuda_device_switches_cuda_matmuls_to_tf32_and_leaves_the_cpu_alone(restored):
    assert restored["cuda matmul"] != "tf32", "the default must be fp32 for the test to mean anything"
    before = cpu_matmul()
    assert use_tf32_on_cuda(torch.device("cuda", 1)) is True
    now = settings()
    assert now["cuda matmul"] == "tf32" and now["cudnn conv"] == restored["cudnn conv"]
    assert now["cpu (oneDNN) matmul"] == restored["cpu (oneDNN) matmul"]
    assert now["cpu (oneDNN) conv"] == restored["cpu (oneDNN) conv"]
    assert torch.equal(cpu_matmul(), before)


def test_placing_the_model_on_the_cpu_leaves_tf32_off(restored):
    cfg = RunConfig.model_validate({"model": {"path": "tiny", "device": "cpu", "dtype": "float32"}})
    model = build_peft_model(cfg, torch.device("cpu"))
    assert any(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    assert settings() == restored
