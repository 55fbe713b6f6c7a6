"""Held-out evaluation on the environment side, without a server: the pass@k estimator, the metrics an eval
reports (metrics.json), failing items, the eval_* config fields, toy's held-out set, and the capture of what an
environment reports through wandb_log."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import sys
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from atroposlib.envs.base import BaseEnv
from pydantic import ValidationError

from environments.common import (
    WANDB_LOG_FILE,
    capturing_reports,
    capturing_wandb_log,
    evaluate_items,
    flushing_run_evaluate,
)
from environments.evaluation import EvalFailed, eval_metrics, pass_at_k, run_items
from environments.gsm8k import GSM8KConfig, preflight
from environments.toy import EVAL_PROMPTS, PROMPTS, ToyEnvConfig
from tests.helpers import free_port


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of the n samples (the first c of which pass) holding at least one pass."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (
                    n,
                    c,
                    k,
                )
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)
    # where C(n, k) overflows a float the product form still answers
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
            pass_at_k(n, c, k)


def test_metrics_of_known_rewards():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.2, 0.0, 0.0], [0.5, 0.9, 0.0, 0.1]]
    metrics = eval_metrics(rewards, threshold=0.5, k=4, failed_items=2)
    assert metrics == {
        "pass@1": pytest.approx((1 / 4 + 0 + 2 / 4) / 3),
        "pass@4": pytest.approx(2 / 3),
        "reward/mean": pytest.approx(2.7 / 12),
        "items": 3,
        "samples_per_item": 4,
        "failed_items": 2,
    }
    two = eval_metrics(rewards, threshold=0.5, k=2)
    assert two["pass@2"] == pytest.approx(((1 - 3 / 6) + 0 + (1 - 1 / 6)) / 3)
    greedy = eval_metrics([[1.0], [0.0], [1.0], [1.0]], threshold=1.0, k=1)
    assert greedy["pass@1"] == 0.75 and "pass@2" not in greedy and greedy["samples_per_item"] == 1
    with pytest.raises(ValueError, match="item 1 has 1 samples, fewer than eval_k=2"):
        eval_metrics([[1.0, 0.0], [1.0]], threshold=1.0, k=2)
    with pytest.raises(ValueError, match="no scored eval items"):
        eval_metrics([], threshold=1.0, k=1)


def test_failing_items_are_counted_and_the_rest_scored_within_the_bound():
    running = peak = 0

    async def score(item: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)
        running -= 1
        if item % 3 == 1:
            raise KeyError(f"answer of {item}")
        return item * 10

    outcome = asyncio.run(run_items(list(range(9)), score, concurrency=2))
    assert outcome.results == [0, 20, 30, 50, 60, 80] and peak == 2
    assert outcome.failures[0] == "item 1: KeyError: 'answer of 1'" and len(outcome.failures) == 3

    async def broken(item: int) -> int:
        raise RuntimeError(f"sampler down ({item})")

    with pytest.raises(
        EvalFailed, match=r"all 2 eval items failed; the first: item 0: RuntimeError: sampler down \(0\)"
    ):
        asyncio.run(run_items([0, 1], broken))


def eval_env(tmp_path: Any, **cfg: Any) -> Any:
    config = SimpleNamespace(
        eval_k=2,
        eval_temperature=1.0,
        eval_max_items=0,
        eval_max_new_tokens=None,
        max_new_tokens=8,
        max_token_length=64,
        model_name="m",
        data_dir_to_save_evals=str(tmp_path),
    )
    vars(config).update(cfg)
    env = SimpleNamespace(config=config, name="toy")
    env.evaluate_log = functools.partial(BaseEnv.evaluate_log, env)
    return env


def test_an_eval_writes_the_metrics_json_the_trainer_reads(tmp_path):
    env = eval_env(tmp_path, eval_max_items=4)

    async def sample(item: int) -> list[tuple[float, dict[str, Any]]]:
        if item == 2:
            raise ValueError("unparsable")
        return [(1.0 if item == 0 else 0.0, {"item": item}), (0.0, {"item": item})]

    asyncio.run(evaluate_items(env, list(range(10)), sample, 1.0, "toy"))
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["results"]["all"] == written["results"]["atropos|toy|0"]
    assert written["results"]["all"] == {
        "pass@1": pytest.approx(1 / 6),
        "pass@2": pytest.approx(1 / 3),
        "reward/mean": pytest.approx(1 / 6),
        "items": 3,
        "samples_per_item": 2,
        "failed_items": 1,
    }
    assert written["config_general"]["generation_parameters"] == {
        "max_new_tokens": 8,
        "temperature": 1.0,
        "n": 2,
    }
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples[0] == {"item": 0, "reward": 1.0} and len(samples) == 6


def test_eval_fields_pass_as_env_flags_and_greedy_pass_at_k_is_refused():
    cfg = ToyEnvConfig(eval_k=4, eval_temperature=1.0, eval_max_items=10, eval_max_new_tokens=32)
    assert (cfg.eval_k, cfg.eval_temperature, cfg.eval_max_items, cfg.eval_max_new_tokens) == (4, 1.0, 10, 32)
    defaults = GSM8KConfig()
    assert (defaults.eval_k, defaults.eval_temperature, defaults.eval_max_items) == (1, 0.0, 0)
    assert defaults.eval_max_new_tokens is None and defaults.eval_split == "test"
    for config_cls in (ToyEnvConfig, GSM8KConfig):
        with pytest.raises(ValidationError, match="eval_k=4 with eval_temperature=0: greedy samples"):
            config_cls(eval_k=4)
    with pytest.raises(ValidationError, match="eval_k"):
        ToyEnvConfig(eval_k=0)
    # atroposlib builds --env.<field> flags from the config class's fields
    assert {"eval_k", "eval_temperature", "eval_max_items", "eval_max_new_tokens"} <= set(
        ToyEnvConfig.model_fields
    )


def test_gsm8k_preflight_checks_a_given_eval_file_only(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert preflight({"data_path": str(train)}) == []
    problems = preflight({"data_path": str(train), "eval_data_path": str(tmp_path / "test.jsonl")})
    assert len(problems) == 1 and "eval_data_path" in problems[0] and "test.jsonl" in problems[0]


def test_toy_held_out_prompts_are_disjoint_from_training():
    assert len(set(EVAL_PROMPTS)) == len(EVAL_PROMPTS) >= 8
    assert set(EVAL_PROMPTS).isdisjoint(PROMPTS)


def test_wandb_log_calls_land_in_the_eval_folder_as_json_lines(tmp_path):
    calls: list[Any] = []

    async def original(self: Any, metrics: Any = None) -> None:
        calls.append(metrics)

    wandb_log = capturing_wandb_log(original)
    env = SimpleNamespace(config=SimpleNamespace(data_dir_to_save_evals=str(tmp_path / "evals")))
    table = object()
    first = {
        "eval/acc": np.float32(0.5),
        "n": np.int64(3),
        "name": "x",
        "table": table,
        "bad": math.nan,
        "l": [1],
    }
    asyncio.run(wandb_log(env, first))
    asyncio.run(wandb_log(env, {"only": table}))  # nothing JSON can hold: no line
    asyncio.run(wandb_log(env, None))
    asyncio.run(wandb_log(env, {"eval/acc": 1}))
    lines = [json.loads(line) for line in (tmp_path / "evals" / WANDB_LOG_FILE).read_text().splitlines()]
    assert lines == [{"eval/acc": 0.5, "n": 3, "name": "x"}, {"eval/acc": 1}]
    assert calls[0] is first and len(calls) == 4  # the original still runs with what it was given
    unset = SimpleNamespace(config=SimpleNamespace(data_dir_to_save_evals=None))
    asyncio.run(wandb_log(unset, {"eval/acc": 1}))
    assert len(calls) == 5


def test_an_eval_metrics_buffer_is_flushed_through_wandb_log_after_evaluate():
    async def run_evaluate(self: Any) -> None:
        self.eval_metrics.append(("eval/percent_correct", 0.25))

    flushed: list[Any] = []

    async def flush(metrics: Any = None) -> None:
        flushed.append(list(env.eval_metrics))

    env = SimpleNamespace(eval_metrics=[], wandb_log=flush)
    asyncio.run(flushing_run_evaluate(run_evaluate)(env))
    assert flushed == [[("eval/percent_correct", 0.25)]]
    quiet = SimpleNamespace(wandb_log=flush)  # no buffer: no extra wandb_log call
    asyncio.run(flushing_run_evaluate(lambda self: asyncio.sleep(0))(quiet))
    assert len(flushed) == 1


def test_the_capture_is_installed_for_an_evaluate_run_only():
    before = (BaseEnv.wandb_log, BaseEnv._run_evaluate)
    with capturing_reports():
        wrapped = BaseEnv.wandb_log
        assert wrapped is not before[0] and BaseEnv._run_evaluate is not before[1]
        with capturing_reports():  # nested: not wrapped twice
            assert BaseEnv.wandb_log is wrapped
    assert (BaseEnv.wandb_log, BaseEnv._run_evaluate) == before


def test_an_eval_target_the_gateway_refuses_ends_the_process_with_its_reason(monkeypatch):
    import environments.common as common

    assert common.eval_target_problem(["--env.eval_k=1"]) is None  # the environment's own default URL
    refused = common.eval_target_problem([f"--openai.base_url=http://127.0.0.1:{free_port()}/eval/base/v1"])
    assert refused is not None and refused.startswith("cannot reach http://127.0.0.1:")
    assert "/eval/base/health (ConnectError" in refused
    answers = {
        "http://gw/eval/eval-step-9/health": (404, "adapter_not_loaded: load it with POST /adapters/load")
    }

    def get(url: str, timeout: float) -> httpx.Response:
        status, text = answers.get(url, (503, ""))
        return httpx.Response(status, text=text)

    monkeypatch.setattr(common.httpx, "get", get)
    assert common.eval_target_problem(["--openai.base_url=http://gw/eval/eval-step-9/v1"]) == (
        "http://gw/eval/eval-step-9/health answered 404: adapter_not_loaded: load it with POST /adapters/load"
    )
    assert (
        common.eval_target_problem(["--openai.base_url=http://gw/eval/base/v1"]) is None
    )  # 503: atroposlib waits


def test_a_refused_eval_flag_exits_with_the_reason_not_a_traceback(monkeypatch):
    import environments.common as common
    from environments.toy import ToyEnv

    monkeypatch.setattr(common, "configure_logging", lambda: None)
    monkeypatch.setattr(ToyEnv, "evaluate_only", False)  # run_cli marks the class for its evaluate process
    monkeypatch.setattr(common, "chat_template_returns_ids", lambda: None)
    monkeypatch.setattr(sys, "argv", ["toy", "evaluate", "--env.eval_k=3", "--env.use_wandb=False"])
    before = (BaseEnv.wandb_log, BaseEnv._run_evaluate)
    with pytest.raises(SystemExit, match=r"evaluate: .*eval_k=3 with eval_temperature=0: greedy samples"):
        common.run_cli(ToyEnv)
    assert (BaseEnv.wandb_log, BaseEnv._run_evaluate) == before  # the capture is taken off again
