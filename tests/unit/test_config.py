"""One config system: every shipped YAML parses; overrides and errors name the dotted key and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.orchestration.commands import resolve_env_module
from trainer.orchestration.launcher import gateway_section
from trainer.training.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").iterdir())  # every file, whatever its name


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"gsm8k.yaml", "tiny_cpu.yaml", "toy.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_validates_for_every_process(path):
    """The run config, its gateway section through the gateway's own model, and its environment."""
    assert path.suffix == ".yaml", f"{path.name}: configs/ holds run configs (*.yaml) only"
    cfg = load_config(RunConfig, path)
    section = gateway_section(cfg, "/model")
    assert section["keep_versions"] >= cfg.rollout.max_staleness
    assert resolve_env_module(cfg.rollout.env)


def test_each_builtin_environment_has_its_default_config():
    """`bash launch.sh ENV` with no --config reads configs/ENV.yaml: it must exist for every built-in env."""
    envs = {p.stem for p in (ROOT / "environments").glob("*.py") if p.stem not in ("__init__", "common")}
    assert envs and all((ROOT / "configs" / f"{env}.yaml").is_file() for env in envs), envs


def test_reference_run_values():
    cfg = load_config(RunConfig, Path(__file__).resolve().parents[2] / "configs" / "gsm8k.yaml")
    assert cfg.model.path == "meta-llama/Llama-3.1-8B-Instruct"
    assert (cfg.lora.rank, cfg.optim.lr, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps) == (
        32,
        4e-5,
        0.9,
        0.95,
        1e-8,
    )
    assert cfg.loss.name == "importance_sampling"


def test_dotted_overrides_are_typed():
    cfg = load_config(
        RunConfig,
        None,
        [
            "optim.lr=2e-5",
            "lora.target_modules=[q_proj, v_proj]",
            "loss.tis_cap=2",
            "model.gradient_checkpointing=true",
        ],
    )
    assert cfg.optim.lr == 2e-5 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.loss.tis_cap == 2.0 and cfg.model.gradient_checkpointing is True


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optim.lr=-1", "optim.lr"),
        ("optim.lrr=1", "optim.lrr"),
        ("loss.name=ppo2", "loss.name"),
        ("loss.reduction=mean", "loss.reduction"),
        ("trainer.micro_batch_tokens=10", "trainer.micro_batch_tokens=10"),
    ],
)
def test_bad_values_name_the_key_and_value(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [override])
    assert needle in str(err.value)
    assert override.split("=", 1)[1] in str(err.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(RunConfig, None, ["optim.lr"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(RunConfig, None, ["optim.lr=1", "optim.lr.x=2"])


def test_tis_cap_with_non_ratio_loss_is_a_config_error():
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(RunConfig, None, ["loss.name=dro", "loss.tis_cap=2"])


def test_grpo_normalises_by_std_unless_told_otherwise():
    assert load_config(RunConfig, None, ["loss.name=grpo"]).normalize_std() is True
    assert load_config(RunConfig, None, ["loss.name=ppo"]).normalize_std() is False
    assert (
        load_config(RunConfig, None, ["loss.name=grpo", "advantage.normalize_std=false"]).normalize_std()
        is False
    )


def test_the_old_gateway_window_key_is_refused_naming_the_new_one(tmp_path):
    """inference.max_staleness (the versions the gateway keeps loaded) is inference.keep_versions now: one line names
    it, from a file, an override, or a RunConfig built in code."""
    for where, args in (
        ("", (None, ["inference.max_staleness=2"])),
        (" in ", (tmp_path / "old.yaml", [])),
    ):
        (tmp_path / "old.yaml").write_text("inference:\n  max_staleness: 2\n")
        with pytest.raises(ConfigError) as err:
            load_config(RunConfig, *args)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"inference.max_staleness{where}")
        assert "is now inference.keep_versions (policy versions behind the current one that stay" in message
    with pytest.raises(ValueError, match=r"is now inference\.keep_versions"):
        RunConfig(inference={"max_staleness": 2})
    # Unset, it follows the trainer's window; set, it may keep more but never fewer.
    cfg = load_config(RunConfig, None, ["rollout.max_staleness=1"])
    assert gateway_section(cfg, "/model")["keep_versions"] == 1
    wider = load_config(RunConfig, None, ["rollout.max_staleness=1", "inference.keep_versions=4"])
    assert gateway_section(wider, "/model")["keep_versions"] == 4
