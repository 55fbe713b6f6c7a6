"""vLLM's dtype follows the trainer's rule on each platform: float32 on CPU for the tiny recipes, bfloat16 on CUDA
(vLLM's CUDA LoRA kernels take no float32), written into the gateway's config by the launcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.training.config import ConfigError, RunConfig, load_config, sampler_dtype

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("config", "cuda", "expected"),
    [("toy.yaml", False, "float32"), ("toy.yaml", True, "bfloat16"), ("gsm8k.yaml", False, "bfloat16")],
)
def test_recipes_resolve_vllm_dtype_per_platform(config, cuda, expected):
    assert sampler_dtype(load_config(RunConfig, CONFIGS / config), cuda) == expected


def test_auto_follows_an_explicit_trainer_dtype_on_cpu_and_float32_on_cuda_is_refused():
    cfg = load_config(RunConfig, CONFIGS / "toy.yaml", ["model.dtype=bfloat16"])
    assert sampler_dtype(cfg, cuda=False) == "bfloat16"
    cfg = load_config(RunConfig, CONFIGS / "toy.yaml", ["inference.vllm.dtype=float32"])
    assert sampler_dtype(cfg, cuda=False) == "float32"
    with pytest.raises(ConfigError, match=r"inference.vllm.dtype=float32.*bfloat16"):
        sampler_dtype(cfg, cuda=True)


def test_the_gateway_config_carries_the_resolved_dtype(monkeypatch):
    from trainer.orchestration import launcher, preflight

    cfg = load_config(RunConfig, CONFIGS / "toy.yaml")
    monkeypatch.setattr(preflight, "probe_gpu_memory", lambda: None)
    section = launcher.gateway_section(cfg, str(preflight.check_model("tiny")), {"port": 0})
    assert section["vllm"]["dtype"] == "float32" and cfg.inference["vllm"]["dtype"] == "float32"
    # A stated GPU (a dry run on a login node for an 80 GiB card) plans the bf16 server.
    cfg = load_config(RunConfig, CONFIGS / "toy.yaml", ["launch.gpu_memory_gib=80"])
    assert launcher.gateway_section(cfg, str(preflight.check_model("tiny")), {"port": 0})["vllm"][
        "dtype"
    ] == ("bfloat16")
