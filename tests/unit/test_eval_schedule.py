"""The run's evaluation schedule and its evaluate processes (trainer/orchestration/evaluation.py), with a stand-in
environment process (a Python one-liner writing what Atropos's evaluate_log and our wandb_log capture write) and a
stand-in gateway that records adapter loads and unloads."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml
from fastapi import FastAPI, Request

from tests.helpers import make_cfg, serve_app
from trainer.orchestration import evaluation
from trainer.orchestration.evaluation import Evaluator, eval_command, read_outputs, read_rows
from trainer.training.checkpoints import adapter_dir

# Writes metrics.json (pass@1 grows with the step in the target's name) and one wandb_log line, like an env would.
FAKE_ENV = """
import json, pathlib, sys, time
out, target, mode = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "hang":
    time.sleep(60)
if mode == "crash":
    print("ValueError: the scorer broke", flush=True)
    sys.exit(3)
if mode == "silent":
    sys.exit(0)
step = int(target.rsplit("-", 1)[1]) if target.startswith("eval-step-") else 0
metrics = {"pass@1": step / 20, "reward/mean": step / 40, "items": 8}
(out / "metrics.json").write_text(json.dumps({"results": {"all": metrics}}))
(out / "wandb_log.jsonl").write_text(json.dumps({"conformance/accuracy": step / 20, "note": "x", "bad": [1]}) + "\\n")
"""


@pytest.fixture
def gateway():
    """A stand-in for the gateway's adapter routes: records each load and unload."""
    app, calls = FastAPI(), []

    @app.post("/adapters/load")
    async def load(request: Request) -> dict[str, str]:
        calls.append(("load", (await request.json())["name"]))
        return {"name": "x"}

    @app.post("/adapters/unload")
    async def unload(request: Request) -> dict[str, str]:
        calls.append(("unload", (await request.json())["name"]))
        return {"name": "x"}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    with serve_app(app, sock) as url:
        yield url, calls


def fake(monkeypatch, mode: str = "ok") -> None:
    def command(cfg, spec, model_path, gateway_url, target, out_dir):
        return [sys.executable, "-c", FAKE_ENV, str(out_dir), target, mode]

    monkeypatch.setattr(evaluation, "eval_command", command)


def run_dir_with_adapters(tmp_path: Path, versions: list[int]) -> Path:
    for v in versions:
        adapter_dir(tmp_path, v).mkdir(parents=True)
    return tmp_path


def settle(ev: Evaluator) -> None:
    deadline = time.monotonic() + 30
    while ev.running is not None:
        assert time.monotonic() < deadline
        ev.poll()
        time.sleep(0.05)


def test_the_schedule_evaluates_base_every_n_steps_and_the_end_and_skips_what_comes_due_while_busy(
    tmp_path, monkeypatch, gateway, capsys
):
    url, calls = gateway
    fake(monkeypatch)
    run_dir = run_dir_with_adapters(tmp_path, [5, 10, 15, 20])
    cfg = make_cfg(run_dir, eval__every_steps=5, rollout__num_steps=20)
    ev = Evaluator(cfg, run_dir, url, {})
    ev.start()
    settle(ev)
    ev.on_row({"step": 5, "policy_version": 5})
    ev.on_row({"step": 10, "policy_version": 10})  # the step-5 evaluation still runs: step 10 waits
    ev.on_row({"step": 15, "policy_version": 15})  # and is replaced by step 15, recorded as skipped
    settle(ev)
    ev.on_row({"step": 12, "policy_version": 12})  # not a multiple of 5
    ev.finish({"step": 20, "policy_version": 20})
    rows = read_rows(run_dir)
    assert [(r["step"], r["target"], r["status"]) for r in rows] == [
        (0, "base", "ok"),
        (10, "step 10", "skipped"),
        (5, "step 5", "ok"),
        (15, "step 15", "ok"),
        (20, "step 20", "ok"),
    ]
    assert rows[2]["eval/pass@1"] == 0.25 and rows[4]["eval/pass@1"] == 1.0 and rows[0]["eval/items"] == 8
    assert rows[4]["reported/conformance/accuracy"] == 1.0 and "reported/bad" not in rows[4]
    assert "step 15 came due while it waited for step 5" in rows[1]["reason"]
    # Adapters are loaded for their evaluation only; the base model needs none.
    assert calls == [(op, f"eval-step-{s}") for s in (5, 15, 20) for op in ("load", "unload")]
    out = capsys.readouterr().out
    assert (
        "eval step 5 (v5) | " in out
        and "pass@1 0.250" in out
        and "step 10 on toy skipped" in out
        and "eval the base model | toy | pass@1 0.000" in out
    )
    # Resumed: the steps already evaluated are not evaluated again.
    again = Evaluator(cfg, run_dir, url, {})
    again.start()
    again.finish({"step": 20, "policy_version": 20})
    assert again.running is None and len(read_rows(run_dir)) == 5


@pytest.mark.parametrize("mode", ["crash", "hang"])
def test_a_failing_or_hanging_evaluation_is_recorded_and_the_run_goes_on(
    tmp_path, monkeypatch, gateway, mode
):
    url, calls = gateway
    fake(monkeypatch, mode)
    run_dir = run_dir_with_adapters(tmp_path, [5])
    cfg = make_cfg(run_dir, eval__every_steps=5, eval__timeout_s=1.0, rollout__num_steps=20)
    ev = Evaluator(cfg, run_dir, url, {})
    ev.on_row({"step": 5, "policy_version": 5})
    settle(ev)
    (row,) = read_rows(run_dir)
    assert row["status"] == "failed" and row["step"] == 5
    if mode == "crash":
        assert "exited with code 3" in row["reason"] and "ValueError: the scorer broke" in row["reason"]
    else:
        assert "eval.timeout_s=1" in row["reason"] and row["seconds"] < 15
    assert calls[-1] == ("unload", "eval-step-5")
    assert (5, "toy") not in ev.done  # a resumed run tries it again


def test_a_missing_adapter_or_a_refusing_gateway_fails_the_evaluation_not_the_run(tmp_path, monkeypatch):
    fake(monkeypatch)
    cfg = make_cfg(tmp_path, eval__every_steps=5, rollout__num_steps=20)
    ev = Evaluator(cfg, tmp_path, "http://127.0.0.1:9", {})
    ev.on_row({"step": 5, "policy_version": 5})  # no adapters/v5
    settle(ev)
    adapter_dir(tmp_path, 10).mkdir(parents=True)
    ev.on_row({"step": 10, "policy_version": 10})  # nothing listens at the gateway's address
    settle(ev)
    reasons = [r["reason"] for r in read_rows(tmp_path)]
    assert "no adapter folder" in reasons[0] and "ConnectError" in reasons[1]


def test_the_evaluate_command_targets_the_eval_routes_and_lets_env_args_win(tmp_path):
    cfg = make_cfg(
        tmp_path,
        eval__every_steps=5,
        eval__k=4,
        eval__temperature=1.0,
        rollout__env_args={"eval_k": 2},
    )
    (spec,) = cfg.rollout.env_specs()
    argv = eval_command(cfg, spec, "/m", "http://gw:1", "eval-step-5", tmp_path / "out")
    assert argv[1:4] == ["-m", "environments.toy", "evaluate"]
    assert "--openai.base_url=http://gw:1/eval/eval-step-5/v1" in argv
    assert f"--env.data_dir_to_save_evals={tmp_path / 'out'}" in argv and "--env.use_wandb=False" in argv
    assert [a for a in argv if a.startswith("--env.eval_k")] == ["--env.eval_k=2"]
    env_file = tmp_path / "my_env.py"
    env_file.write_text("")
    cfg.rollout.env = str(env_file)
    (spec,) = cfg.rollout.env_specs()
    argv = eval_command(cfg, spec, "/m", "http://gw:1", "base", tmp_path / "out")
    assert argv[1:5] == ["-m", "environments.upstream", str(env_file), "evaluate"]
    assert "--user-keys=eval_k" in argv


def test_unreadable_outputs_count_as_nothing_reported(tmp_path):
    (tmp_path / "metrics.json").write_text('{"results": {"all": {"pass@1": NaN, "acc": "x", "n": 3}}}')
    (tmp_path / "wandb_log.jsonl").write_text('not json\n[1]\n{"a": 1, "b": Infinity}\n')
    assert read_outputs(tmp_path) == ({"n": 3.0}, [{"a": 1}])
    (tmp_path / "metrics.json").write_text("[")
    assert read_outputs(tmp_path)[0] == {}


def test_greedy_pass_at_k_is_refused(tmp_path):
    with pytest.raises(ValueError, match="greedy samples of one prompt are identical"):
        make_cfg(tmp_path, eval__k=4)


def test_the_eval_command_compares_base_and_the_newest_adapter_on_a_running_gateway(
    tmp_path, monkeypatch, gateway, capsys
):
    from trainer.orchestration import eval_cli

    url, calls = gateway
    fake(monkeypatch)
    monkeypatch.setattr(eval_cli, "check_model", lambda path: path)
    run_dir = run_dir_with_adapters(tmp_path / "run", [3, 7])
    for v in (3, 7):
        (adapter_dir(run_dir, v) / "adapter_config.json").write_text("{}")
    cfg = make_cfg(run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "cmp.json"
    assert eval_cli.main([str(run_dir), "--gateway", url, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["target"] for r in result["rows"]] == ["base", "v7"]
    assert calls == [("load", "cmp-0"), ("unload", "cmp-0")]
    printed = capsys.readouterr().out
    assert "target  pass@1  reward/mean  items  seconds  status" in printed and "v7 vs base: " in printed
    # the stand-in scores by the step in the target's name: the run's versions score as the base model
    assert result["differences"] == {"toy": {"v7": {"eval/pass@1": 0.0, "eval/reward/mean": 0.0}}}
    # What cannot be evaluated is said before anything starts.
    assert eval_cli.main(["--version", "3", "--config", str(run_dir / "config.yaml")]) == 2
    assert eval_cli.main([str(run_dir), "--adapter", str(tmp_path)]) == 2
    assert eval_cli.main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert (
        "--version N needs a run folder" in err
        and "not a PEFT adapter folder" in err
        and "no config.yaml" in err
    )


def test_an_environment_that_reports_nothing_is_said_once_and_not_evaluated_again(
    tmp_path, monkeypatch, gateway, capsys
):
    url, _ = gateway
    fake(monkeypatch, "silent")
    run_dir = run_dir_with_adapters(tmp_path, [5, 10])
    ev = Evaluator(make_cfg(run_dir, eval__every_steps=5, rollout__num_steps=20), run_dir, url, {})
    ev.start()
    settle(ev)
    ev.on_row({"step": 5, "policy_version": 5})
    ev.finish({"step": 20, "policy_version": 20})
    assert [(r["step"], r["status"]) for r in read_rows(run_dir)] == [(0, "nothing")]
    assert capsys.readouterr().out.count("reported nothing") == 1


def test_a_mixed_run_evaluates_every_environment_under_keys_of_its_own(tmp_path, monkeypatch, gateway):
    url, calls = gateway
    seen = []

    def command(cfg, spec, model_path, gateway_url, target, out_dir):
        seen.append((spec.name, target))
        return [
            sys.executable,
            "-c",
            FAKE_ENV,
            str(out_dir),
            target,
            "silent" if spec.name == "quiet" else "ok",
        ]

    monkeypatch.setattr(evaluation, "eval_command", command)
    run_dir = run_dir_with_adapters(tmp_path, [5])
    envs = [{"env": "toy", "weight": 3}, {"env": "toy", "name": "quiet", "weight": 1}]
    cfg = make_cfg(run_dir, eval__every_steps=5, rollout__num_steps=20, rollout__envs=envs)
    ev = Evaluator(cfg, run_dir, url, {})
    ev.start()
    settle(ev)
    ev.on_row({"step": 5, "policy_version": 5})
    settle(ev)
    rows = read_rows(run_dir)
    assert [(r["step"], r["env"], r["status"]) for r in rows] == [
        (0, "toy", "ok"),
        (0, "quiet", "nothing"),
        (5, "toy", "ok"),
    ]
    assert rows[2]["eval/toy/pass@1"] == 0.25 and "eval/pass@1" not in rows[2]
    assert seen == [
        ("toy", "base"),
        ("quiet", "base"),
        ("toy", "eval-step-5"),
    ]  # quiet: said once, then left out
    assert (run_dir / "eval" / "toy" / "eval-step-5" / "metrics.json").is_file()
    assert calls == [("load", "eval-step-5"), ("unload", "eval-step-5")]


class FakeEvaluation:
    """An evaluation that finishes after `polls` calls of done(); counts how many run at once."""

    running = 0
    most = 0

    def __init__(self, target: evaluation.Target, polls: int):
        self.target, self.polls, self.stopped = target, polls, False
        FakeEvaluation.running += 1
        FakeEvaluation.most = max(FakeEvaluation.most, FakeEvaluation.running)

    def done(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def result(self) -> dict[str, str]:
        FakeEvaluation.running -= 1
        return {"target": self.target.name}

    def stop(self) -> None:
        self.stopped = True
        FakeEvaluation.running -= 1


def test_evaluations_run_up_to_jobs_at_once_and_rows_keep_the_targets_order(monkeypatch):
    from trainer.orchestration.eval_cli import evaluate_together

    monkeypatch.setattr(time, "sleep", lambda s: None)
    FakeEvaluation.running = FakeEvaluation.most = 0
    targets = [evaluation.Target(f"t{i}") for i in range(5)]
    polls = {"t0": 6, "t1": 1, "t2": 3, "t3": 1, "t4": 2}  # t0 finishes last: its row still comes first
    rows = evaluate_together(lambda t: FakeEvaluation(t, polls[t.name]), targets, jobs=2)
    assert [r["target"] for r in rows] == ["t0", "t1", "t2", "t3", "t4"]
    assert FakeEvaluation.most == 2 and FakeEvaluation.running == 0
    FakeEvaluation.most = 0
    evaluate_together(lambda t: FakeEvaluation(t, 1), targets, jobs=1)
    assert FakeEvaluation.most == 1


def test_an_interrupted_evaluation_round_stops_what_is_still_running(monkeypatch):
    from trainer.orchestration.eval_cli import evaluate_together

    started: list[FakeEvaluation] = []

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    def start(target: evaluation.Target) -> FakeEvaluation:
        started.append(FakeEvaluation(target, 100))
        return started[-1]

    monkeypatch.setattr(time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate_together(start, [evaluation.Target("a"), evaluation.Target("b")], jobs=4)
    assert [e.stopped for e in started] == [True, True]
