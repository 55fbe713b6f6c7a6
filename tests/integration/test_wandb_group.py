"""launch.wandb=true, offline, read back with W&B's own reader (`wandb leet inspect --json`, which parses a run's
.wandb transaction log): the run's W&B group holds the trainer's metrics, the toy environment's and the held-out
evaluations', each run with its config.

The real pieces of a run, without vLLM: atroposlib's run-api, the toy environment process started from the
launcher's own Component (its command line and W&B environment, stopped as the launcher stops it), a gateway over
the scripted sampler (tests/scripted_gateway.py), the trainer's RunApi and MetricsWriter in this process under the
trainer's W&B environment, and the launcher's Evaluator (toy's evaluate processes: the base model, step 2, and the
final policy after the trainer has finished). Left out: the optimizer step (W&B sees the rows the writer is given;
each step "publishes" a stand-in adapter folder the scripted gateway loads for its evaluation)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inference.app import create_app
from inference.config import GatewayConfig
from inference.policy.registry import Policy, PolicyRegistry
from inference.wire import Sample, SamplingRequest
from tests.helpers import run_api, serve_app
from tests.scripted_gateway import ScriptedBackend, make_adapter
from trainer.orchestration.commands import ROOT, build_components
from trainer.orchestration.evaluation import Evaluator
from trainer.orchestration.processes import stop_all
from trainer.training.checkpoints import adapter_dir
from trainer.training.config import RunConfig, load_config
from trainer.training.metrics_file import MetricsWriter
from trainer.training.runapi_client import RunApi, sampled_tokens, wait_for_batch
from trainer.training.wandb_group import wandb_group

STEPS = 4
# Every kind of secret a run's config can hold: a key named as one, a flag's value in an argument list, the
# credential part of a URL. None may reach the run's folder (W&B's files included).
SECRETS = {
    "inference.publish_token": "publish-Zq81xT",
    "service.api_key": "service-Kd02pW",
    "service.gateway_token": "gateway-Rm55vB",
}
ARG_SECRET, URL_SECRET = "vllm-key-Hy73cN", "url-pass-Tt19aQ"


def read_wandb_run(run_folder: Path) -> list[dict[str, Any]]:
    """The records of one offline run, as W&B's reader of .wandb files prints them."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_folder)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_MODE": "offline"},
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run record (group, job type, config) and every history key the run logged."""
    run = next(r["run"] for r in records if r["type"] == "run")
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    steps = [row["eval/step"] for row in rows if "eval/step" in row]
    return {**run, "history_keys": {k for row in rows for k in row}, "eval_steps": steps}


class ToyTokens(ScriptedBackend):
    """The scripted samples as token ids the tiny model's tokenizer decodes (a named adapter's policy version,
    the script's first token, is negative)."""

    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]:
        samples = await super().sample(req, policy)
        return [s.model_copy(update={"token_ids": [abs(t) + 3 for t in s.token_ids]}) for s in samples]


def gateway_app(model_path: Path) -> Any:
    backend = ToyTokens()
    backend.max_model_len = 512  # the toy prompts and 16 new tokens
    cfg = GatewayConfig(model=str(model_path), vllm={"max_lora_rank": 8})
    return create_app(cfg, backend, PolicyRegistry("base", 3), vocab_size=2048, start_backend=False)


def test_the_runs_wandb_group_holds_trainer_environment_and_eval_metrics(
    tmp_path, tiny_model_path, monkeypatch
):
    run_dir = tmp_path / "toy-wandb"
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "toy.yaml",
        [
            f"model.path={tiny_model_path}",
            f"trainer.output_dir={run_dir}",
            "launch.wandb=true",
            "launch.wandb_project=test-project",
            "rollout.groups_per_step=2",  # atroposlib logs a step once it sent 2 groups in it
            f"rollout.num_steps={STEPS}",
            "eval.every_steps=2",
            "eval.max_items=2",
            *(f"{k}={v}" for k, v in SECRETS.items()),
            f"inference.vllm.extra_args=[--api-key, {ARG_SECRET}, '--x-url=https://u:{URL_SECRET}@x.example/']",
        ],
    )
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    # No W&B login (no .netrc entry, no settings file): the launcher picks offline.
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-settings"))
    (run_dir / "logs").mkdir(parents=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    with run_api(tmp_path) as api_url, serve_app(gateway_app(tiny_model_path), sock) as gateway_url:
        cfg.launch.run_api_url, cfg.launch.gateway_url = api_url, gateway_url
        components = {c.name: c for c in build_components(cfg, run_dir, str(tiny_model_path))}
        env, trainer = components["env"], components["trainer"]
        assert env.env["WANDB_MODE"] == trainer.env["WANDB_MODE"] == "offline"
        env.start()  # before this process has a W&B service of its own, which a child would attach to
        for key, value in trainer.env.items():  # this process plays the trainer the launcher would start
            monkeypatch.setenv(key, value)
        api = RunApi(cfg, api_url, str(run_dir / "logs" / "run-api.log"))
        api.register(0)
        writer = MetricsWriter(run_dir / "metrics.jsonl", cfg.launch.wandb, cfg)
        deadline = time.monotonic() + 300  # the environment's start and STEPS batches, on a loaded CPU
        evaluator = Evaluator(cfg, run_dir, gateway_url, {})  # the launcher's: base, every 2 steps, the end
        evaluator.start()
        last: dict[str, Any] = {}
        try:
            for step in range(1, STEPS + 1):
                groups = wait_for_batch(api, 0.2, meanwhile=lambda: meanwhile(env, evaluator, deadline))
                scores = [s for g in groups for s in g["scores"]]
                last = {"step": step, "policy_version": step, "reward/mean": statistics.fmean(scores)}
                writer.write({**last, "tokens/sampled": sampled_tokens(groups)})
                publish_adapter(run_dir, step)  # what the trainer's publish leaves for the evaluations
                evaluator.on_row(last)
                time.sleep(1.0)  # the environment sees each step (run-api /status) and logs after it
            writer.close()  # the trainer exits after its last step; the final evaluation comes after it
            evaluator.finish(last)
        finally:
            evaluator.stop()
            stop_all([env], timeout_s=30)  # SIGTERM, as the launcher stops a run
            writer.close()
    runs = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        info = summarize(read_wandb_run(folder))
        runs[info["job_type"]] = info
    assert set(runs) == {"trainer", "environment", "eval"}, runs.keys()
    assert {r["run_group"] for r in runs.values()} == {wandb_group(run_dir)}
    assert {r["project"] for r in runs.values()} == {"test-project"}
    trainer_run, env_run, eval_run = runs["trainer"], runs["environment"], runs["eval"]
    assert {"reward/mean", "tokens/sampled"} <= trainer_run["history_keys"]
    assert not any(k.startswith("eval/") for k in trainer_run["history_keys"])
    assert trainer_run["config"]["update"]["rollout"]["env"] == "toy"
    assert {"eval/pass@1", "eval/reward/mean", "eval/step"} <= eval_run["history_keys"], eval_run[
        "history_keys"
    ]
    assert eval_run["eval_steps"] == [0, 2, STEPS]  # the base model, step 2 and the final policy
    assert eval_run["config"]["update"]["eval"]["every_steps"] == 2
    env_keys = env_run["history_keys"]
    # atroposlib's own keys, without its per-registration prefix (environments.common.wandb_run_per_process)
    assert {"train/completion_lengths", "train/rollouts._type"} <= env_keys, env_keys
    assert not any(k.startswith("toy-0_") for k in env_keys), env_keys
    assert env_run["config"]["update"]["group_size"] == cfg.rollout.group_size
    assert trainer_run["config"]["update"]["inference"]["publish_token"] == "<hidden>"
    for path in (p for p in run_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for secret in [*SECRETS.values(), ARG_SECRET, URL_SECRET]:
            assert secret.encode() not in data, f"{secret} in {path}"


def meanwhile(env: Any, evaluator: Evaluator, deadline: float) -> None:
    """What the launcher does while the trainer waits for a batch: watch the environment, drive the evaluations."""
    assert_running(env, deadline)
    evaluator.poll()


def publish_adapter(run_dir: Path, version: int) -> None:
    folder = adapter_dir(run_dir, version)
    make_adapter(folder.parent, folder.name)  # the scripted gateway reads only its config


def assert_running(comp: Any, deadline: float) -> None:
    assert comp.exited() is None, f"{comp.name} exited with {comp.exited()}:\n{comp.tail()}"
    assert time.monotonic() < deadline, f"no batch from {comp.name} in time:\n{comp.tail()}"
