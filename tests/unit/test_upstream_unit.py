"""environments/upstream without a server: which class a file runs, which flags it gets, the one server config
every declared shape becomes, and the transformers-4 chat template ids."""

from __future__ import annotations

import logging

import pytest
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline

from environments.common import chat_template_returns_ids
from environments.upstream.envfile import (
    EnvFileError,
    gateway_server_configs,
    load_env_class,
    main_class_name,
    split_flags,
)
from environments.upstream.probe import Limits, Report, Seen, check_prompts

GATEWAY = {
    "openai.base_url": "http://127.0.0.1:7/v1",
    "openai.model_name": "/m",
    "openai.server_type": "vllm",
}


def test_the_class_the_file_runs_is_the_one_in_its_main_block():
    source = 'class A: ...\nclass B(A): ...\nif __name__ == "__main__":\n    B.cli()\n'
    assert main_class_name(source) == "B"
    assert main_class_name("class A: ...\n") is None


def test_a_file_with_two_environments_and_no_main_block_is_refused(tmp_path):
    env = tmp_path / "two.py"
    env.write_text(
        "from atroposlib.envs.base import BaseEnv\nclass One(BaseEnv): ...\nclass Two(BaseEnv): ...\n"
    )
    with pytest.raises(EnvFileError, match=r"cannot tell which.*One, Two"):
        load_env_class(env)
    missing = tmp_path / "needs.py"
    missing.write_text("import not_a_real_package_xyz\n")
    with pytest.raises(EnvFileError, match=r"not_a_real_package_xyz.*not installed"):
        load_env_class(missing)


def test_only_declared_env_flags_pass_and_own_options_are_taken_out():
    argv = [
        "--env.group_size=4",
        "--env.seed=3",
        "--openai.base_url=http://x/v1",
        "--user-keys=a",
        "--max-seq-len=9",
    ]
    flags = split_flags(argv, {"group_size"})
    assert flags.kept == ["--env.group_size=4", "--openai.base_url=http://x/v1"]
    assert flags.dropped == ["seed"] and flags.options == {"user-keys": "a", "max-seq-len": "9"}


@pytest.mark.parametrize(
    "declared",
    [
        APIServerConfig(base_url="http://localhost:9001/v1", model_name="x", timeout=77),
        ServerBaseline(model_name="x", timeout=77),
        [APIServerConfig(base_url="http://localhost:9001/v1", model_name="x", timeout=77)],
        [APIServerConfig(base_url=f"http://localhost:{p}/v1", model_name="x", timeout=77) for p in (1, 2, 3)],
    ],
    ids=["single", "baseline", "list-of-one", "list-of-three"],
)
def test_every_declared_server_shape_becomes_one_gateway_server(declared):
    configs = gateway_server_configs(declared, {}, {}, GATEWAY, logging.getLogger("t"))
    assert isinstance(configs, list) and len(configs) == 1  # a list: ServerManager uses it as given
    assert configs[0].base_url == "http://127.0.0.1:7/v1" and configs[0].model_name == "/m"
    assert configs[0].server_type == "vllm" and configs[0].timeout == 77  # the declared limits are kept


def test_prompt_check_names_the_limit_that_leaves_no_room():
    limits = {"rollout.max_token_length": 256, "trainer.max_seq_len": 512}
    skipped = Report()  # prompts rendered, no request sent: the environment skipped them
    check_prompts(Seen([30, 300], requests=0), Limits(limits), skipped)
    assert len(skipped.problems) == 1 and "up to 300 tokens" in skipped.problems[0]
    assert "rollout.max_token_length=256 leaves no room" in skipped.problems[0]
    sent = Report()  # an environment that uses max_token_length as the completion budget sends them anyway
    check_prompts(Seen([30, 300], requests=2), Limits(limits), sent)
    assert not sent.problems and "still sends them" in sent.notes[-1]
    trainer = Report()  # past the trainer's limit nothing is left to train, sent or not
    check_prompts(Seen([600], requests=2), Limits(limits), trainer)
    assert "trainer.max_seq_len=512 leaves no room" in trainer.problems[0]
    fine = Report()
    check_prompts(Seen([30], requests=1), Limits(limits), fine)
    assert not fine.problems and "up to 30 tokens" in fine.notes[0]


def test_chat_template_gives_token_ids_as_transformers_4_did(tiny_model_path):
    from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer
    from transformers import AutoTokenizer

    chat_template_returns_ids()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    out = tokenize_for_trainer(tok, chat)
    assert all(isinstance(t, int) for t in out["tokens"]) and len(out["tokens"]) == len(out["masks"])
    assert out["masks"][0] == -100 and out["masks"][-1] == out["tokens"][-1]
    # a caller that asks for the dict still gets it
    assert "input_ids" in tok.apply_chat_template(chat, return_dict=True)
