"""The verifiers v1 runner's pure parts (no verifiers installed here): a trace branch's message nodes to the
sequence run-api receives, checked against a hand-built multi-turn trajectory, the refusals that keep the trained
tokens the sampled ones, and the launcher's choice of venv and runner for a `vf:` file that imports verifiers.v1."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from environments.verifiers_runner.trajectory import NOT_TRAINED, PROMPT_LOGPROB, TrajectoryError
from environments.verifiers_v1_runner.trajectory import NodeTokens, build_branch
from trainer.orchestration.commands import (
    VERIFIERS_PY,
    VERIFIERS_V1_PY,
    env_command,
    env_preflight_command,
    is_verifiers_v1,
    resolve_env_module,
)
from trainer.training.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
VF1_TOY = "tests/envs/vf1_toy.py"


def test_a_multi_turn_branch_trains_only_the_sampled_ids_with_their_logprobs():
    """Hand-built: system + user prompt, a reply (template prefix unsampled, 2 sampled ids), a tool turn, and a
    second reply. The environment's turns and the template scaffold are prompt positions."""
    nodes = [
        NodeTokens([1, 2, 3], [False] * 3, []),  # system + user
        NodeTokens([4, 40, 41], [False, True, True], [-0.5, -1.25]),  # "assistant:" + sampled
        NodeTokens([5, 6, 7], [False] * 3, []),  # tool output
        NodeTokens([4, 42], [False, True], [-0.1]),
    ]
    built = build_branch(nodes, "t")
    assert built.tokens == [1, 2, 3, 4, 40, 41, 5, 6, 7, 4, 42]
    assert built.masks == [NOT_TRAINED] * 4 + [40, 41] + [NOT_TRAINED] * 4 + [42]
    assert built.logprobs == [PROMPT_LOGPROB] * 4 + [-0.5, -1.25] + [PROMPT_LOGPROB] * 4 + [-0.1]
    assert (built.turns, built.untrained_turns) == (2, 0)


def test_sampled_ids_inside_a_node_keep_their_own_logprobs_in_order():
    built = build_branch(
        [NodeTokens([1], [False], []), NodeTokens([9, 8, 7], [True, False, True], [-1, -2])], "t"
    )
    assert built.masks == [NOT_TRAINED, 9, NOT_TRAINED, 7]
    assert built.logprobs == [PROMPT_LOGPROB, -1.0, PROMPT_LOGPROB, -2.0]


@pytest.mark.parametrize(
    ("node", "says"),
    [
        (NodeTokens([1, 2], [True], [-0.1]), "2 token ids but a mask of 1"),
        (NodeTokens([1, 2], [True, True], [-0.1]), "2 sampled ids but 1 logprobs"),
        (NodeTokens([1], [False], [-0.1]), "0 sampled ids but 1 logprobs"),
        (NodeTokens([1], [True], [math.nan]), "not a finite number"),
        (NodeTokens([1], [True], [0.5]), "not a finite number <= 0"),
        (NodeTokens([-4], [True], [-0.1]), "token_ids holds -4"),
        (NodeTokens([True], [True], [-0.1]), "token_ids holds True"),  # type: ignore[list-item]
    ],
)
def test_tokens_that_cannot_be_trained_as_sampled_are_refused_naming_the_node(node: NodeTokens, says: str):
    with pytest.raises(TrajectoryError, match=f"branch 0 node 1: .*{says}"):
        build_branch([NodeTokens([1], [False], []), node], "branch 0")


def test_a_branch_without_a_sampled_token_is_refused():
    with pytest.raises(TrajectoryError, match="no sampled token"):
        build_branch([NodeTokens([1, 2], [False, False], [])], "b")
    with pytest.raises(TrajectoryError, match="no sampled token"):
        build_branch([], "b")


def config(*overrides: str) -> RunConfig:
    return load_config(RunConfig, ROOT / "configs" / "tiny_cpu.yaml", list(overrides))


def test_a_file_that_imports_verifiers_v1_is_a_v1_environment(tmp_path: Path):
    assert is_verifiers_v1(str(ROOT / VF1_TOY))
    assert not is_verifiers_v1(str(ROOT / "tests/envs/vf_toy.py"))
    assert not is_verifiers_v1("my-installed-env")
    mentioned = tmp_path / "mentions.py"
    mentioned.write_text(
        '"""Not verifiers.v1: import verifiers.v1 only in this text."""\nimport verifiers as vf\n'
    )
    assert not is_verifiers_v1(str(mentioned))
    indented = tmp_path / "indented.py"
    indented.write_text("try:\n    from verifiers.v1 import Taskset\nexcept ImportError:\n    pass\n")
    assert is_verifiers_v1(str(indented))


def test_launch_sh_picks_the_same_venv_as_the_launcher(tmp_path: Path):
    """launch.sh greps the file for the pattern commands.is_verifiers_v1 searches: the venv it builds is the one
    the launcher runs."""
    source = (ROOT / "launch.sh").read_text()
    start = source.index("verifiers_v1_file() {")
    function = source[start : source.index("\n}\n", start) + 3]
    files = [
        str(ROOT / VF1_TOY),
        str(ROOT / "tests/envs/vf_toy.py"),
        "my-installed-env",
    ]
    for case in (
        "import verifiers.v1 as vf\n",
        "  from verifiers.v1.types import X\n",
        "import verifiers.v10\n",
    ):
        path = tmp_path / f"case{len(files)}.py"
        path.write_text(case)
        files.append(str(path))
    script = function + 'for f in "$@"; do if verifiers_v1_file "$f"; then echo 1; else echo 0; fi; done'
    out = subprocess.run(
        ["bash", "-c", script, "-", *files], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == [str(int(is_verifiers_v1(f))) for f in files] == ["1", "0", "0", "1", "1", "0"]


def test_a_v1_environment_runs_in_the_v1_venv_with_its_args():
    cfg = config(f"rollout.env=vf:{VF1_TOY}", "rollout.env_args={target_seed: 7, harness: vf1_toy}")
    spec = cfg.rollout.env_specs()[0]
    assert spec.is_verifiers and spec.name == "vf1_toy"
    argv = env_command(cfg, "/model", 0)
    assert argv[:4] == [str(VERIFIERS_V1_PY), "-m", "environments.verifiers_v1_runner", "serve"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in argv[4:])
    assert flags["env.vf_env"] == str(ROOT / VF1_TOY)
    assert json.loads(flags["env.vf_env_args"]) == {"target_seed": 7, "harness": "vf1_toy"}
    assert flags["openai.base_url"].endswith(
        "/v1"
    )  # the runner's client posts to the root's /inference/v1/generate
    # v0 is unchanged
    v0 = env_command(config("rollout.env=vf:tests/envs/vf_toy.py"), "/model", 0)
    assert v0[:3] == [str(VERIFIERS_PY), "-m", "environments.verifiers_runner"]
    assert resolve_env_module("vf:my-env")[:3] == [str(VERIFIERS_PY), "-m", "environments.verifiers_runner"]


def test_the_v1_preflight_names_the_v1_venv_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    cfg = config(f"rollout.env=vf:{VF1_TOY}")
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setattr("trainer.orchestration.commands.VERIFIERS_V1_PY", python)
    argv = env_preflight_command(cfg, "/model/folder")
    assert argv is not None and argv[:4] == [
        str(python),
        "-m",
        "environments.verifiers_v1_runner",
        "preflight",
    ]
    assert "--env.tokenizer_name=/model/folder" in argv
    monkeypatch.setattr("trainer.orchestration.commands.VERIFIERS_V1_PY", tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"verifiers venv .* is missing.*--setup-verifiers-v1"):
        env_preflight_command(cfg, "/model/folder")
