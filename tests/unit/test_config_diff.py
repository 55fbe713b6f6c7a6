"""The differences a comparison report lists (trainer/readout/config_diff.py): everything but where each run ran."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.readout.config_diff import config_differences


def local_and_tinker(folder: str = "/models/tiny") -> tuple[dict, dict]:
    shared = {
        "optim": {"lr": 1e-2},
        "lora": {"rank": 8, "target_modules": "all-linear"},
        "rollout": {"seed": 42},
    }
    local = {
        **shared,
        "launch": {
            "backend": "local",
            "run_api_url": "http://127.0.0.1:1",
            "gateway_url": "http://127.0.0.1:2",
        },
        "model": {"path": folder},
        "trainer": {"output_dir": "/runs/cmp/local"},
        "tinker": {"tokenizer": None},
        "inference": {"vllm": {"dtype": "float32"}},
    }
    tinker = {
        **shared,
        "launch": {
            "backend": "tinker",
            "run_api_url": "http://127.0.0.1:3",
            "gateway_url": "http://127.0.0.1:4",
        },
        "model": {"path": "tiny"},
        "trainer": {"output_dir": "/runs/cmp/tinker"},
        "tinker": {"tokenizer": folder},
        "inference": {},
    }
    return local, tinker


def test_the_same_recipe_on_two_backends_differs_in_nothing():
    local, tinker = local_and_tinker()
    assert config_differences({"local": local, "tinker": tinker}) == []


def test_a_changed_key_a_missing_key_and_another_model_are_listed():
    local, tinker = local_and_tinker()
    tinker["optim"] = {"lr": 2e-2}
    tinker["loss"] = {"name": "ppo"}
    assert config_differences({"local": local, "tinker": tinker}) == [
        "loss.name: local=(unset), tinker='ppo'",
        "optim.lr: local=0.01, tinker=0.02",
    ]
    other, _ = local_and_tinker("/models/other")
    assert config_differences({"local": other, "tinker": tinker})[0] == (
        "model: local=/models/other, tinker=/models/tiny"
    )


def test_gateway_settings_count_between_runs_of_one_backend():
    a, _ = local_and_tinker()
    b = json.loads(json.dumps(a))
    b["inference"]["vllm"]["dtype"] = "bfloat16"
    assert config_differences({"a": a, "b": b}) == ["inference.vllm.dtype: a='float32', b='bfloat16'"]


def test_the_comparison_report_lists_the_differences(tmp_path: Path):
    from trainer.readout.report import main

    for name, cfg in zip(("local", "tinker"), local_and_tinker(), strict=True):
        folder = tmp_path / name
        folder.mkdir()
        if name == "tinker":
            cfg["optim"] = {"lr": 5e-3}
        (folder / "config.yaml").write_text(json.dumps(cfg))
        (folder / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "reward/mean": 0.5, "wall_s": 1.0}) + "\n"
        )
    assert main([str(tmp_path / "local"), str(tmp_path / "tinker"), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Config differences beyond the backend\n\n- optim.lr: local=0.01, tinker=0.005\n" in report
    assert json.loads((tmp_path / "report" / "differences.json").read_text()) == [
        "optim.lr: local=0.01, tinker=0.005"
    ]
