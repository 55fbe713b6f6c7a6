"""The verifiers runner's pure parts (no verifiers installed here): a rollout's turns to the sequence run-api
receives, the checks that keep the trained tokens the sampled ones, and the launcher's `vf:` commands."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from environments.verifiers_runner.preflight import tool_problem
from environments.verifiers_runner.trajectory import (
    NOT_TRAINED,
    PROMPT_LOGPROB,
    TrajectoryError,
    Turn,
    build_sequence,
    scored_group,
    turn_from_tokens,
)
from trainer.orchestration.commands import (
    VERIFIERS_PY,
    env_command,
    env_preflight_command,
    resolve_env_module,
)
from trainer.training.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
VF_TOY = "tests/envs/vf_toy.py"


def test_a_single_turn_trains_the_sampled_ids_with_their_logprobs():
    built = build_sequence([Turn([5, 6, 7], [40, 41, 2], [-0.5, -1.25, -0.1])])
    assert built.tokens == [5, 6, 7, 40, 41, 2]
    assert built.masks == [NOT_TRAINED] * 3 + [40, 41, 2]
    assert built.logprobs == [PROMPT_LOGPROB] * 3 + [-0.5, -1.25, -0.1]
    assert (built.turns, built.untrained_turns) == (1, 0)


def test_turns_merge_with_the_environment_tokens_between_them_masked():
    """A hand-built three-turn trajectory: each prompt is everything before it plus the environment's turn (the
    chat template's delimiters and a user or tool message). Only sampled ids are trained."""
    t1 = Turn([1, 2, 3], [10, 11], [-0.1, -0.2])
    t2 = Turn([1, 2, 3, 10, 11, 50, 51], [12, 13], [-0.3, -0.4])
    t3 = Turn([1, 2, 3, 10, 11, 50, 51, 12, 13, 60], [14], [-0.5])
    built = build_sequence([t1, t2, t3])
    assert built.tokens == [1, 2, 3, 10, 11, 50, 51, 12, 13, 60, 14]
    assert built.tokens == t3.prompt_ids + t3.completion_ids  # what the gateway's ledger recorded
    x = NOT_TRAINED
    assert built.masks == [x, x, x, 10, 11, x, x, 12, 13, x, 14]
    assert built.logprobs == [1.0, 1.0, 1.0, -0.1, -0.2, 1.0, 1.0, -0.3, -0.4, 1.0, -0.5]
    trained = [t for t, m in zip(built.tokens, built.masks, strict=True) if m != NOT_TRAINED]
    assert trained == [*t1.completion_ids, *t2.completion_ids, *t3.completion_ids]
    assert built.untrained_turns == 0


def test_token_in_tool_turns_are_prompt_and_every_sampled_token_is_trained():
    """A hand-built tool-using rollout whose every prompt extends the earlier ids exactly as sampled (token-in
    turns, or a chat template that keeps them): then come the chat template's end-of-turn ids the sampler did not
    produce (a reply cut at max_tokens has none of its own), the tool's answer and the next assistant header. Those
    are prompt positions; the three replies (a tool call, a second call, the answer) are trained with their sampler
    logprobs."""
    end, header = [2, 13], [3, 30, 13]  # <|im_end|> newline; <|im_start|> assistant newline
    tool_turn = [3, 40, 13, 41, 42]  # <|im_start|> tool newline '4' ... (the tool's output)
    call_1, call_2, answer = [70, 71, 2], [72, 73], [74, 2]  # the second call was cut at max_tokens
    t1 = Turn([1, 5, 6, *header], call_1, [-0.1, -0.2, -0.3])
    t2 = Turn([*t1.prompt_ids, *call_1, 13, *tool_turn, *end, *header], call_2, [-0.4, -0.5])
    t3 = Turn([*t2.prompt_ids, *call_2, *end, *tool_turn, *end, *header], answer, [-0.6, -0.7])
    built = build_sequence([t1, t2, t3])
    assert built.tokens == t3.prompt_ids + t3.completion_ids  # what the ledger recorded for the last call
    assert built.untrained_turns == 0
    trained = [
        (t, lp) for t, m, lp in zip(built.tokens, built.masks, built.logprobs, strict=True) if m != -100
    ]
    assert [t for t, _ in trained] == [*call_1, *call_2, *answer]
    assert [lp for _, lp in trained] == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]
    prompt = [t for t, m in zip(built.tokens, built.masks, strict=True) if m == NOT_TRAINED]
    assert prompt.count(41) == 2 and 30 in prompt  # both tool outputs and every header stay prompt
    assert all(
        lp == PROMPT_LOGPROB for m, lp in zip(built.masks, built.logprobs, strict=True) if m == NOT_TRAINED
    )


def test_a_tool_environment_needs_a_vllm_with_a_tool_call_parser():
    no_parser = tool_problem("vf_tool", "ToolEnv", True, "[]")
    assert no_parser is not None and "--enable-auto-tool-choice" in no_parser and "vf_tool" in no_parser
    assert tool_problem("vf_tool", "ToolEnv", True, '["--enable-auto-tool-choice"]') is not None
    parsers = (
        '["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]',
        '["--enable-auto-tool-choice", "--tool-call-parser=hermes"]',
    )
    assert all(tool_problem("vf_tool", "ToolEnv", True, p) is None for p in parsers)
    assert tool_problem("vf_toy", "GoOnEnv", False, "[]") is None  # no tools: nothing to parse
    assert tool_problem("vf_tool", "ToolEnv", True, None) is None  # not a local vLLM (Tinker)


def test_a_re_rendered_earlier_reply_leaves_only_the_last_turn_trained():
    """The chat template turned the first reply's text into other ids: those are not what was sampled, so they
    stay prompt, and the last turn's own sample is trained."""
    t1 = Turn([1, 2, 3], [10, 11], [-0.1, -0.2])
    t2 = Turn([1, 2, 3, 99, 50], [12], [-0.3])
    built = build_sequence([t1, t2])
    assert built.tokens == [1, 2, 3, 99, 50, 12]
    assert built.masks == [NOT_TRAINED] * 5 + [12]
    assert built.logprobs == [1.0] * 5 + [-0.3]
    assert built.untrained_turns == 1


@pytest.mark.parametrize(
    ("turn", "says"),
    [
        (Turn([1], [2, 3], [-0.1]), "2 sampled token ids but 1 logprobs"),
        (Turn([1], [2], [math.nan]), "not a finite number"),
        (Turn([1], [2], [0.5]), "not a finite number <= 0"),
        (Turn([1, -4], [2], [-0.1]), "prompt_token_ids holds -4"),
        (Turn([1], ["2"], [-0.1]), "token_ids holds '2'"),  # type: ignore[list-item]
        (Turn([], [2], [-0.1]), "empty prompt_token_ids"),
    ],
)
def test_tokens_that_cannot_be_trained_as_sampled_are_refused(turn: Turn, says: str):
    with pytest.raises(TrajectoryError, match=says):
        build_sequence([Turn([1], [2], [-0.1]), turn])


def test_a_rollout_without_model_calls_is_refused():
    with pytest.raises(TrajectoryError, match="no model call"):
        build_sequence([])


def test_a_step_without_token_record_names_the_gateway_fields():
    with pytest.raises(TrajectoryError, match="return_token_ids and logprobs"):
        turn_from_tokens(None, "turn 0")
    with pytest.raises(TrajectoryError, match="unreadable token record"):
        turn_from_tokens({"prompt_ids": [1]}, "turn 0")
    turn = turn_from_tokens(
        {"prompt_ids": [1, 2], "completion_ids": [3], "completion_logprobs": [-1], "prompt_mask": [0, 0]}, "t"
    )
    assert turn == Turn([1, 2], [3], [-1.0])


def test_the_group_has_the_fields_managed_server_environments_send():
    a = build_sequence([Turn([1, 2], [3], [-0.1])])
    b = build_sequence([Turn([1, 2], [4, 5], [-0.2, -0.3])])
    group = scored_group([a, b], [0.25, 1])
    assert group == {
        "tokens": [[1, 2, 3], [1, 2, 4, 5]],
        "masks": [[-100, -100, 3], [-100, -100, 4, 5]],
        "scores": [0.25, 1.0],
        "inference_logprobs": [[1.0, 1.0, -0.1], [1.0, 1.0, -0.2, -0.3]],
    }
    assert all(
        len(t) == len(m) == len(lp)
        for t, m, lp in zip(*(group[k] for k in ("tokens", "masks", "inference_logprobs")))
    )
    with pytest.raises(TrajectoryError, match="finite number"):
        scored_group([a, b], [0.5, math.inf])
    with pytest.raises(TrajectoryError, match="2 sequences but 1 scores"):
        scored_group([a, b], [0.5])


def config(*overrides: str) -> RunConfig:
    return load_config(RunConfig, ROOT / "configs" / "tiny_cpu.yaml", list(overrides))


def test_a_vf_environment_runs_in_the_verifiers_venv_with_its_args_for_load_environment():
    cfg = config(f"rollout.env=vf:{VF_TOY}", "rollout.env_args={turns: 3, target_seed: 7}")
    spec = cfg.rollout.env_specs()[0]
    assert spec.is_verifiers and not spec.is_file
    assert spec.name == "vf_toy"
    argv = env_command(cfg, "/model", 0)
    assert argv[:4] == [str(VERIFIERS_PY), "-m", "environments.verifiers_runner", "serve"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in argv[4:])
    assert flags["env.vf_env"] == str(ROOT / VF_TOY)
    assert json.loads(flags["env.vf_env_args"]) == {"turns": 3, "target_seed": 7}
    assert "env.turns" not in flags and "env.target_seed" not in flags  # not the runner's flags
    assert flags["env.wandb_name"] == "vf_toy-0"
    assert flags["openai.base_url"].endswith("/v1")


def test_an_installed_vf_environment_is_passed_by_its_id():
    cfg = config("rollout.env=vf:my-env")
    assert cfg.rollout.env_specs()[0].name == "my-env"
    flags = dict(a.removeprefix("--").split("=", 1) for a in env_command(cfg, "/model", 0)[4:])
    assert flags["env.vf_env"] == "my-env"


def test_vf_names_that_cannot_run_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="name the verifiers environment after vf:"):
        resolve_env_module("vf:")
    with pytest.raises(ConfigError, match=r"no such verifiers environment file 'nope\.py'"):
        resolve_env_module("vf:nope.py")


def test_the_vf_preflight_gets_the_tokenizer_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    cfg = config(f"rollout.env=vf:{VF_TOY}")
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setattr("trainer.orchestration.commands.VERIFIERS_PY", python)
    argv = env_preflight_command(cfg, "/model/folder")
    assert argv is not None and argv[1:4] == ["-m", "environments.verifiers_runner", "preflight"]
    assert "--env.tokenizer_name=/model/folder" in argv
    assert "--env.vllm_extra_args=[]" in argv  # the pre-flight checks a tool environment against it
    tools = config(f"rollout.env=vf:{VF_TOY}", "inference.vllm.extra_args=[--enable-auto-tool-choice]")
    assert '--env.vllm_extra_args=["--enable-auto-tool-choice"]' in (env_preflight_command(tools, "/m") or [])
    monkeypatch.setattr("trainer.orchestration.commands.VERIFIERS_PY", tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"verifiers venv .* is missing"):
        env_preflight_command(cfg, "/model/folder")


def test_the_eval_process_of_a_vf_environment_gets_its_args_and_the_eval_flags(tmp_path: Path):
    from trainer.orchestration.evaluation import eval_command

    cfg = config(
        f"rollout.env=vf:{VF_TOY}", "rollout.env_args={turns: 2}", "eval.k=2", "eval.temperature=1.0"
    )
    argv = eval_command(cfg, cfg.rollout.env_specs()[0], "/model", "http://gw", "base", tmp_path)
    assert argv[:4] == [str(VERIFIERS_PY), "-m", "environments.verifiers_runner", "evaluate"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in argv[4:])
    assert flags["openai.base_url"] == "http://gw/eval/base/v1"
    assert (flags["env.eval_k"], flags["env.vf_env"]) == ("2", str(ROOT / VF_TOY))
    assert json.loads(flags["env.vf_env_args"]) == {"turns": 2}
