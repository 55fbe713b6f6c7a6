"""Held-out evaluation of a run's policies, by the environment's own evaluate(): one short process per evaluation
(`python -m environments.<name> evaluate`, Atropos's own entry point), sampling one fixed target through the
gateway's /eval/<target>/ routes. Those routes bypass the on-policy gate, its quota and the version ledger, so an
evaluation never delays, counts towards or leaks into training; it only shares vLLM's throughput.

A target is the base model or an adapter folder; a folder is loaded into the gateway under a name of its own for
the evaluation and unloaded after it. What the process reports (its evaluate_log metrics.json and every wandb_log
call, captured by environments.common) becomes one row of RUN_DIR/eval.jsonl, failed or not: a failing evaluation
is recorded with its reason and never stops training.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from trainer.orchestration.commands import ROOT, flag, resolve_env_module
from trainer.orchestration.processes import Component, stop_all
from trainer.training.checkpoints import adapter_dir, write_atomic
from trainer.training.config import RunConfig

EVAL_FILE = "eval.jsonl"
EVAL_DIR = "eval"  # RUN_DIR/eval/<target>/: each evaluation's process log and what it wrote
BASE = "base"  # the gateway's name for the base model under /eval/
NOTHING = "nothing"  # the status of an evaluation whose environment reported nothing: it has no eval set
LOAD_TIMEOUT_S = 300.0  # an adapter load into vLLM (seconds on a GPU; a restarting vLLM takes longer)


@dataclass(frozen=True)
class Target:
    """What one evaluation samples: the base model (adapter None) or an adapter folder, served as `name`."""

    name: str
    adapter: Path | None = None
    step: int | None = None  # the training step it is the policy of, when it is one
    version: int | None = None

    @property
    def label(self) -> str:
        if self.adapter is None:
            return BASE
        if self.step is not None:
            return f"step {self.step}"
        return f"v{self.version}" if self.version is not None else str(self.adapter)


def step_target(step: int, version: int, run_dir: Path) -> Target:
    """The policy a run trained up to `step`: the base model before any step, else the adapter it published."""
    if version <= 0 or step <= 0:
        return Target(BASE, None, step, version)
    return Target(f"eval-step-{step}", adapter_dir(run_dir, version), step, version)


def eval_command(cfg: RunConfig, model_path: str, gateway_url: str, target: str, out_dir: Path) -> list[str]:
    """The environment's evaluate process against /eval/<target>/. The eval_* flags are the built-in
    environments' own; an environment file's runner drops the flags its config does not declare."""
    r, e = cfg.rollout, cfg.eval
    flags: dict[str, Any] = {
        "env.tokenizer_name": model_path,
        "env.use_wandb": False,  # atroposlib's evaluate turns W&B on unless told
        "env.data_dir_to_save_evals": str(out_dir),
        "env.wandb_name": f"{Path(r.env).stem}-eval",
        "env.max_token_length": r.max_token_length,
        "env.seed": r.seed,
        "env.eval_k": e.k,
        "env.eval_temperature": e.temperature,
        "env.eval_max_items": e.max_items,
        "env.eval_max_new_tokens": e.max_new_tokens or r.max_new_tokens,
        "openai.base_url": f"{gateway_url}/eval/{target}/v1",
        "openai.api_key": "local",
        "openai.model_name": model_path,
        "openai.tokenizer_name": model_path,
        "openai.server_type": "vllm",
    }
    for key in r.env_args:  # rollout.env_args wins, as in training
        flags.pop(f"env.{key}", None)
    own = [f"--user-keys={','.join(r.env_args)}"] if r.env.endswith(".py") else []
    return [
        *resolve_env_module(r.env),
        "evaluate",
        *(flag(k, v) for k, v in flags.items()),
        *(flag(f"env.{k}", v) for k, v in r.env_args.items()),
        *own,
    ]


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_outputs(out_dir: Path) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(metrics, reported): the numbers of evaluate_log's metrics.json ('all' results), and each wandb_log call
    the environment made. Anything unreadable counts as not reported."""
    metrics: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        results = json.loads((out_dir / "metrics.json").read_text())["results"]
        everything: dict[str, Any] = results.get("all") or next(iter(results.values()), {})
        metrics = {str(k): float(v) for k, v in everything.items() if finite(v)}
    reported: list[dict[str, Any]] = []
    with contextlib.suppress(OSError):
        for line in (out_dir / "wandb_log.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    reported.append({k: v for k, v in entry.items() if finite(v) or isinstance(v, str)})
    return metrics, reported


def eval_row(
    target: Target,
    env: str,
    seconds: float,
    metrics: dict[str, float],
    reported: list[dict[str, Any]],
    failed: str | None,
) -> dict[str, Any]:
    """One row of eval.jsonl: the target, `eval/<key>` for each metric the environment reported through
    evaluate_log, and its wandb_log numbers (the last value of each key) under `reported/<key>`."""
    row: dict[str, Any] = {
        "step": target.step,
        "policy_version": target.version,
        "target": target.label,
        "env": Path(env).stem,
        "status": "failed" if failed else "ok",
        "reason": failed,
        "seconds": round(seconds, 3),
        "unix_time": time.time(),
    }
    row.update({f"eval/{k}": v for k, v in metrics.items()})
    for entry in reported:
        row.update({f"reported/{k}": v for k, v in entry.items() if finite(v)})
    return row


def line(row: dict[str, Any]) -> str:
    """The printed line of one evaluation."""
    where = row["target"] if row.get("step") is None else f"step {row['step']} (v{row['policy_version']})"
    if row["status"] != "ok":
        return f"eval {where} | {row['env']} | FAILED after {row['seconds']:.1f}s: {row['reason']}"
    shown = [
        f"{k.removeprefix('eval/')} {v:.3f}"
        for k, v in row.items()
        if k.startswith("eval/pass@") or k == "eval/reward/mean"
    ]
    items = row.get("eval/items")
    return (
        f"eval {where} | {row['env']} | "
        + " | ".join(shown or ["no pass@k or reward reported"])
        + (f" | {items:.0f} items" if items is not None else "")
        + f" | {row['seconds']:.1f}s"
    )


class Evaluation:
    """One evaluation in flight: the adapter loaded, the process running, a deadline."""

    def __init__(
        self, cfg: RunConfig, gateway_url: str, out_root: Path, target: Target, auth: dict[str, str]
    ):
        self.cfg, self.target, self.gateway_url, self.auth = cfg, target, gateway_url, auth
        self.out_dir = out_root / target.name
        self.started = time.monotonic()
        self.deadline = self.started + cfg.eval.timeout_s
        self.failed: str | None = None
        self.loaded = False
        shutil.rmtree(self.out_dir, ignore_errors=True)  # a rerun of the same target starts clean
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.proc = Component(
            f"eval-{target.name}",
            eval_command(cfg, cfg.model.path, gateway_url, target.name, self.out_dir),
            self.out_dir / "eval.log",
            cwd=ROOT,
        )
        try:
            self._load()
            self.proc.start()
        except (httpx.HTTPError, OSError, RuntimeError) as exc:
            self.failed = f"{type(exc).__name__}: {exc}"

    def _load(self) -> None:
        if self.target.adapter is None:
            return
        if not self.target.adapter.is_dir():
            raise RuntimeError(f"no adapter folder {self.target.adapter}")
        body = {"name": self.target.name, "adapter_path": str(self.target.adapter)}
        reply = httpx.post(
            f"{self.gateway_url}/adapters/load", json=body, headers=self.auth, timeout=LOAD_TIMEOUT_S
        )
        if reply.status_code != 200:
            raise RuntimeError(f"the gateway refused to load {self.target.adapter}: {reply.text[:300]}")
        self.loaded = True

    def _unload(self) -> None:
        if not self.loaded:
            return
        with contextlib.suppress(httpx.HTTPError):  # a gateway restart unloaded it already
            httpx.post(
                f"{self.gateway_url}/adapters/unload",
                json={"name": self.target.name},
                headers=self.auth,
                timeout=60,
            )
        self.loaded = False

    def done(self) -> bool:
        if self.failed is not None:
            return True
        code = self.proc.exited()
        if code is None and time.monotonic() > self.deadline:
            self.failed = f"took over eval.timeout_s={self.cfg.eval.timeout_s:.0f}s; stopped"
            self.stop()
            return True
        if code is not None and code != 0:
            self.failed = (
                f"the evaluate process exited with code {code}; read {self.proc.log}: {last_error(self.proc)}"
            )
        return code is not None

    def stop(self) -> None:
        stop_all([self.proc], timeout_s=10)
        self._unload()

    def result(self) -> dict[str, Any]:
        """The row, once done(); unloads the adapter."""
        self._unload()
        metrics, reported = read_outputs(self.out_dir)
        row = eval_row(
            self.target, self.cfg.rollout.env, time.monotonic() - self.started, metrics, reported, self.failed
        )
        if self.failed is None and not metrics and not reported:
            # An environment whose evaluate() does nothing (many upstream files: `pass`) has no eval set here.
            row.update(
                status=NOTHING, reason="its evaluate() reported nothing (no evaluate_log or wandb_log call)"
            )
        return row


def last_error(comp: Component) -> str:
    """The log's last line that names an error, else its last line."""
    lines = [ln for ln in comp.tail(40).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln or "Exit" in ln]
    return (errors or lines or ["(empty log)"])[-1][:300]


def append_row(run_dir: Path, row: dict[str, Any]) -> None:
    path = run_dir / EVAL_FILE
    text = path.read_text() if path.exists() else ""
    write_atomic(path, text + json.dumps(row) + "\n")


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    with contextlib.suppress(OSError):
        for text in (run_dir / EVAL_FILE).read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(text)
                if isinstance(row, dict):
                    rows.append(row)
    return rows


def evaluate_now(ev: Evaluation) -> dict[str, Any]:
    """Run one evaluation to its end (or deadline) and return its row."""
    while not ev.done():
        time.sleep(0.2)
    return ev.result()


class Evaluator:
    """The run's evaluation schedule, driven by the supervisor's poll: the base model at the start, every
    eval.every_steps steps as the trainer's metrics rows arrive, and the final policy at the end. One evaluation
    runs at a time and one waits: a step that comes due while another waits replaces it, and the replaced one is
    recorded as skipped. Steps with an `ok` row in eval.jsonl are not evaluated again (a resumed run re-reads its
    rows from the start, so it evaluates what an interruption left out, newest first)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, gateway_url: str, auth: dict[str, str]):
        self.cfg, self.run_dir, self.gateway_url, self.auth = cfg, run_dir, gateway_url, auth
        self.done_steps = {r["step"] for r in read_rows(run_dir) if r.get("status") == "ok"}
        self.running: Evaluation | None = None
        self.waiting: Target | None = None
        self.off = not cfg.eval.on

    def start(self) -> None:
        if not self.off and self.cfg.eval.at_start and 0 not in self.done_steps:
            self._begin(step_target(0, 0, self.run_dir))

    def on_row(self, row: dict[str, Any]) -> None:
        step, version = row.get("step"), row.get("policy_version")
        if self.off or not isinstance(step, int) or not isinstance(version, int):
            return
        if step % self.cfg.eval.every_steps or step in self.done_steps or step >= self.cfg.rollout.num_steps:
            return  # the last step is the end's evaluation (finish)
        target = step_target(step, version, self.run_dir)
        if self.running is None:
            self._begin(target)
            return
        if self.waiting is not None:
            self._skip(self.waiting, f"step {step} came due while it waited for {self.running.target.label}")
        self.waiting = target

    def poll(self) -> None:
        if self.running is not None and self.running.done():
            self._record(self.running.result())
        if self.running is None and self.waiting is not None:
            target, self.waiting = self.waiting, None
            self._begin(target)

    def finish(self, last: dict[str, Any] | None) -> None:
        """After the last step: finish what runs and waits, then evaluate the final policy (blocking)."""
        if not self.cfg.eval.on:
            return
        while self.running is not None:
            self.poll()
            time.sleep(0.2)
        if self.off or not self.cfg.eval.at_end:
            return
        if last is not None and last.get("step") not in self.done_steps:
            print(f"eval: evaluating the final policy (step {last['step']})", flush=True)
            self._begin(step_target(int(last["step"]), int(last["policy_version"]), self.run_dir))
            assert self.running is not None
            self._record(evaluate_now(self.running))

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None

    def _begin(self, target: Target) -> None:
        self.running = Evaluation(self.cfg, self.gateway_url, self.run_dir / EVAL_DIR, target, self.auth)

    def _skip(self, target: Target, why: str) -> None:
        row = eval_row(target, self.cfg.rollout.env, 0.0, {}, [], why)
        append_row(self.run_dir, {**row, "status": "skipped"})
        print(f"eval: {target.label} skipped: {why}", flush=True)

    def _record(self, row: dict[str, Any]) -> None:
        self.running = None
        append_row(self.run_dir, row)
        if row["status"] == "ok":
            self.done_steps.add(row["step"])
        if row["status"] == NOTHING:
            self.off = True  # said once, not at every step
            self.waiting = None
            print(
                f"eval: {row['env']}'s evaluate() reported nothing (no evaluate_log or wandb_log call): it has no "
                "eval set here; no more evaluations in this run",
                flush=True,
            )
            return
        print(line(row), flush=True)
