"""The gateway reads the served model's vocabulary size and expert count from config.json before vLLM starts,
without importing transformers where the file states them, and with transformers' defaults where it does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.__main__ import refuse_moe_on_cpu, resolve_model, text_config
from inference.config import GatewayConfigError


def model_folder(tmp_path: Path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_plain_models_vocabulary_is_read_from_the_top_level(tmp_path):
    folder = model_folder(tmp_path, {"model_type": "llama", "vocab_size": 128256})
    assert resolve_model(folder) == (folder, 128256)


def test_a_composite_models_text_section_is_the_one_read(tmp_path):
    """A vision-language config: the text model's vocabulary (and experts) sit under text_config."""
    config = {
        "model_type": "some_vlm",
        "vision_config": {"hidden_size": 64},
        "text_config": {"vocab_size": 151936, "num_experts": 8},
    }
    folder = model_folder(tmp_path, config)
    assert resolve_model(folder)[1] == 151936
    with pytest.raises(GatewayConfigError, match=r"\(8 experts per layer\)"):
        refuse_moe_on_cpu(folder, "cpu")
    refuse_moe_on_cpu(folder, "cuda")


def test_a_file_without_a_vocabulary_size_gets_transformers_default(tmp_path):
    from transformers import AutoConfig

    folder = model_folder(tmp_path, {"model_type": "llama"})
    default = AutoConfig.for_model("llama").vocab_size
    assert text_config(folder)["vocab_size"] == default
    assert resolve_model(folder)[1] == default


def test_a_folder_without_a_config_is_refused_by_name(tmp_path):
    with pytest.raises(GatewayConfigError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(GatewayConfigError, match="is not a model folder"):
        resolve_model(str(tmp_path / "missing"))
