"""rlcommon/redaction.py: the one redaction the dry run, W&B and the dashboard use."""

from __future__ import annotations

from pathlib import Path

from rlcommon.redaction import HIDDEN, redact, redact_override
from trainer.readout.dashboard_data import config_text
from trainer.training.config import RunConfig, load_config

SECRETS = {
    "publish": "pub-0123456789abcdef",
    "teacher": "sk-teacher-0123456789",
    "service": "tml-service-0123456789abcdef",
    "vllm": "vllm-key-0123456789",
    "url_password": "hunter2-0123456789",
}


def test_secrets_are_hidden_wherever_they_sit_and_the_rest_is_kept():
    data = {
        "model": {"path": "tiny", "max_tokens": 7, "tokenizer": "t"},
        "inference": {
            "publish_token": SECRETS["publish"],
            "vllm": {
                "api_key": SECRETS["vllm"],
                "extra_args": ["--api-key", "k1-secret", "--api-key=k2-secret"],
            },
        },
        "distill": {
            "teacher": f"https://user:{SECRETS['url_password']}@teacher.example/v1",
            "teacher_api_key": None,
        },
        "service": {"api_key": SECRETS["service"], "gateway_token": ""},
        "env_args": ["--openai.api_key=rl-env:toy", "--env.max_token_length=256"],
    }
    out = redact(data)
    text = repr(out)
    for secret in [*SECRETS.values(), "k1-secret", "k2-secret", "rl-env:toy"]:
        assert secret not in text, secret
    assert out["model"] == data["model"]  # max_tokens and tokenizer are no secrets
    assert out["distill"]["teacher"] == f"https://{HIDDEN}@teacher.example/v1"
    assert (
        out["distill"]["teacher_api_key"] is None and out["service"]["gateway_token"] == ""
    )  # unset stays unset
    assert out["env_args"][1] == "--env.max_token_length=256"
    assert (
        redact_override(f"inference.publish_token={SECRETS['publish']}")
        == f"inference.publish_token={HIDDEN}"
    )
    assert redact_override("rollout.num_steps=5") == "rollout.num_steps=5"


def test_the_dashboard_hides_block_values_list_items_and_url_credentials(tmp_path: Path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "inference:\n"
        "  publish_token: |\n"
        f"    {SECRETS['publish']}\n"
        "  vllm:\n"
        "    extra_args:\n"
        "    - --api-key\n"
        f"    - {SECRETS['vllm']}\n"
        f"distill:\n  teacher: http://u:{SECRETS['url_password']}@h:1/v1\n"
    )
    text, problem = config_text(config)
    assert problem is None and text is not None
    for secret in (SECRETS["publish"], SECRETS["vllm"], SECRETS["url_password"]):
        assert secret not in text, text
    # A file that does not parse is still shown, line by line, its secrets hidden.
    config.write_text(
        f"inference:\n  publish_token: {SECRETS['publish']}\n  : [\nteacher: http://a:{SECRETS['url_password']}@b\n"
    )
    text, _ = config_text(config)
    assert text is not None and SECRETS["publish"] not in text and SECRETS["url_password"] not in text


def test_the_trainers_wandb_config_is_redacted(tmp_path: Path, monkeypatch):
    import sys
    import types

    from trainer.training.metrics_file import MetricsWriter

    captured: dict = {}
    fake = types.SimpleNamespace(init=lambda **kw: captured.update(kw) or types.SimpleNamespace(log=None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("trainer.training.metrics_file.current_mode", lambda: "offline")
    cfg = load_config(
        RunConfig,
        None,
        [
            f"inference.publish_token={SECRETS['publish']}",
            "distill.teacher=http://127.0.0.1:9/v1",
            f"distill.teacher_api_key={SECRETS['teacher']}",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    MetricsWriter(tmp_path / "metrics.jsonl", True, cfg)
    text = repr(captured["config"])
    assert SECRETS["publish"] not in text and SECRETS["teacher"] not in text
    assert captured["config"]["inference"]["publish_token"] == HIDDEN
