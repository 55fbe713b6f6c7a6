"""One LoRA definition for both backends (trainer/training/lora_spec.py): each shipped recipe's lora.* maps onto
Tinker's switches so that the Tinker side (the Tinker-protocol service's LoraSpec, what the tinker SDK asks for)
adapts exactly the modules, rank and scale the local backend adapts; what the switches cannot express is refused,
before anything starts, with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainer.service.policies import LoraSpec
from trainer.training.config import ConfigError, RunConfig, load_config
from trainer.training.lora_spec import TINKER_ALPHA, module_targets, tinker_lora_flags

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("recipe", ["toy", "tiny_cpu", "gsm8k"])
def test_each_recipe_trains_the_same_modules_rank_and_scale_on_both_backends(recipe, tmp_path):
    cfg = load_config(RunConfig, ROOT / "configs" / f"{recipe}.yaml", ["launch.backend=tinker"])
    flags = tinker_lora_flags(cfg.lora)
    tinker_side = LoraSpec(rank=cfg.lora.rank, seed=cfg.lora.seed, **flags)
    assert sorted(tinker_side.targets()) == sorted(module_targets(cfg.lora.target_modules))
    assert cfg.lora.alpha == TINKER_ALPHA and cfg.lora.dropout == 0


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["lora.target_modules=[q_proj,v_proj]"], "Tinker trains q_proj, k_proj, v_proj, o_proj together"),
        (["lora.target_modules=[q_proj,k_proj,v_proj,o_proj,embed_tokens]"], "names ['embed_tokens']"),
        (["lora.alpha=16"], "lora.alpha=16: the tinker SDK sets no alpha"),
        (["lora.dropout=0.1"], "Tinker's LoRA has no dropout"),
    ],
)
def test_what_tinker_cannot_express_is_refused_with_the_reason(overrides, needle):
    with pytest.raises(ConfigError, match="lora") as err:
        load_config(RunConfig, ROOT / "configs" / "toy.yaml", ["launch.backend=tinker", *overrides])
    assert needle in str(err.value)
    load_config(RunConfig, ROOT / "configs" / "toy.yaml", overrides)  # the local backend takes them all


def test_the_tinker_backend_asks_for_exactly_those_switches(tmp_path, monkeypatch):
    from tests import fake_tinker
    from trainer.backends.tinker import TinkerBackend

    asked: dict[str, Any] = {}
    original = fake_tinker.FakeServiceClient.create_lora_training_client

    def record(self: Any, base_model: str, rank: int = 32, seed: int | None = None, **flags: Any) -> Any:
        asked.update(rank=rank, **flags)
        return original(self, base_model, rank, seed)

    monkeypatch.setattr(fake_tinker.FakeServiceClient, "create_lora_training_client", record)
    monkeypatch.setenv("FAKE_TINKER_ROOT", str(tmp_path / "tinker"))
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "tiny_cpu.yaml",
        [f"trainer.output_dir={tmp_path / 'run'}", "launch.backend=tinker", "lora.target_modules=all-linear"],
    )
    TinkerBackend(cfg, service=fake_tinker.FakeServiceClient())
    assert asked == {"rank": cfg.lora.rank, "train_attn": True, "train_mlp": True, "train_unembed": False}
