"""Held-out evaluation of a run's policies, by the environment's own evaluate(): one short process per evaluation
(`python -m environments.<name> evaluate`, Atropos's own entry point), sampling one fixed target through the
gateway's /eval/<target>/ routes. Those routes bypass the on-policy gate, its quota and the version ledger, so an
evaluation never delays, counts towards or leaks into training; it only shares vLLM's throughput.

A target is the base model or an adapter folder; a folder is loaded into the gateway under a name of its own for
the evaluation and unloaded after it. What the process reports (its evaluate_log metrics.json and every wandb_log
call, captured by environments.common) becomes one row of RUN_DIR/eval.jsonl, failed or not: a failing evaluation
is recorded with its reason and never stops training. With launch.wandb each `ok` row also goes to the run's W&B
group (trainer.training.wandb_group.EvalRun).
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

from trainer.orchestration.commands import ROOT, flag, resolve_env_module, verifiers_flags
from trainer.orchestration.processes import Component, stop_all
from trainer.training.checkpoints import adapter_dir, write_atomic
from trainer.training.config import RunConfig
from trainer.training.rollout_config import EnvSpec
from trainer.training.wandb_group import EvalRun

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


def eval_command(
    cfg: RunConfig, spec: EnvSpec, model_path: str, gateway_url: str, target: str, out_dir: Path
) -> list[str]:
    """The environment's evaluate process against /eval/<target>/. The eval_* flags are the built-in
    environments' own; an environment file's runner drops the flags its config does not declare."""
    r, e = cfg.rollout, cfg.eval
    flags: dict[str, Any] = {
        "env.tokenizer_name": model_path,
        "env.use_wandb": False,  # atroposlib's evaluate turns W&B on unless told
        "env.data_dir_to_save_evals": str(out_dir),
        "env.wandb_name": f"{spec.name}-eval",
        "env.max_token_length": spec.max_token_length,
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
    if spec.is_verifiers:  # env_args are load_environment's, as in training
        flags.update(verifiers_flags(spec, "rollout.env"))
        return [*resolve_env_module(spec.env), "evaluate", *(flag(k, v) for k, v in flags.items())]
    for key in spec.env_args:  # the environment's own args win, as in training
        flags.pop(f"env.{key}", None)
    own = [f"--user-keys={','.join(spec.env_args)}"] if spec.is_file else []
    return [
        *resolve_env_module(spec.env),
        "evaluate",
        *(flag(k, v) for k, v in flags.items()),
        *(flag(f"env.{k}", v) for k, v in spec.env_args.items()),
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
    keyed: bool = False,
) -> dict[str, Any]:
    """One row of eval.jsonl: the target, `eval/<key>` for each metric the environment reported through
    evaluate_log, and its wandb_log numbers (the last value of each key) under `reported/<key>`; with `keyed` (a
    run of several environments) `eval/<env>/<key>` and `reported/<env>/<key>`, so each environment's curves and
    W&B keys stay apart."""
    prefix = f"{env}/" if keyed else ""
    row: dict[str, Any] = {
        "step": target.step,
        "policy_version": target.version,
        "target": target.label,
        "env": env,
        "status": "failed" if failed else "ok",
        "reason": failed,
        "seconds": round(seconds, 3),
        "unix_time": time.time(),
    }
    row.update({f"eval/{prefix}{k}": v for k, v in metrics.items()})
    for entry in reported:
        row.update({f"reported/{prefix}{k}": v for k, v in entry.items() if finite(v)})
    return row


def scores(row: dict[str, Any]) -> dict[str, float]:
    """A row's `eval/` numbers by the environment's own key (without `eval/` and the environment's prefix)."""
    prefix = f"eval/{row.get('env')}/"
    return {
        k.removeprefix(prefix) if k.startswith(prefix) else k.removeprefix("eval/"): v
        for k, v in row.items()
        if k.startswith("eval/") and finite(v)
    }


def line(row: dict[str, Any]) -> str:
    """The printed line of one evaluation."""
    if row.get("step") is None or row["target"] == BASE:
        where = "the base model" if row["target"] == BASE else row["target"]
    else:
        where = f"step {row['step']} (v{row['policy_version']})"
    if row["status"] != "ok":
        return f"eval {where} | {row['env']} | FAILED after {row['seconds']:.1f}s: {row['reason']}"
    numbers = scores(row)
    shown = [f"{k} {v:.3f}" for k, v in numbers.items() if k.startswith("pass@") or k == "reward/mean"]
    items = numbers.get("items")
    return (
        f"eval {where} | {row['env']} | "
        + " | ".join(shown or ["no pass@k or reward reported"])
        + (f" | {items:.0f} items" if items is not None else "")
        + f" | {row['seconds']:.1f}s"
    )


class Evaluation:
    """One evaluation in flight: the adapter loaded, the process running, a deadline."""

    def __init__(
        self,
        cfg: RunConfig,
        spec: EnvSpec,
        gateway_url: str,
        out_root: Path,
        target: Target,
        auth: dict[str, str],
        keyed: bool = False,
    ):
        self.cfg, self.spec, self.target, self.gateway_url, self.auth = cfg, spec, target, gateway_url, auth
        self.keyed = keyed
        self.out_dir = out_root / spec.name / target.name
        self.started = time.monotonic()
        self.deadline = self.started + cfg.eval.timeout_s
        self.failed: str | None = None
        self.loaded = False
        shutil.rmtree(self.out_dir, ignore_errors=True)  # a rerun of the same target starts clean
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.proc = Component(
            f"eval-{spec.name}-{target.name}",
            eval_command(cfg, spec, cfg.model.path, gateway_url, target.name, self.out_dir),
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
        seconds = time.monotonic() - self.started
        row = eval_row(self.target, self.spec.name, seconds, metrics, reported, self.failed, self.keyed)
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
    eval.every_steps steps as the trainer's metrics rows arrive, and the final policy at the end, each on every
    environment of the run in turn. One target is evaluated at a time and one waits: a step that comes due while
    another waits replaces it, and the replaced one is recorded as skipped. (step, environment) pairs with an `ok`
    row in eval.jsonl are not evaluated again (a resumed run re-reads its rows from the start, so it evaluates what
    an interruption left out, newest first). An environment whose evaluate() reports nothing is said once and not
    evaluated again."""

    def __init__(self, cfg: RunConfig, run_dir: Path, gateway_url: str, auth: dict[str, str]):
        self.cfg, self.run_dir, self.gateway_url, self.auth = cfg, run_dir, gateway_url, auth
        self.specs = cfg.rollout.env_specs()
        self.keyed = len(self.specs) > 1
        self.done = {(r.get("step"), r.get("env")) for r in read_rows(run_dir) if r.get("status") == "ok"}
        self.running: Evaluation | None = None
        self.queue: list[EnvSpec] = []  # the running target's environments still to evaluate
        self.waiting: Target | None = None
        self.silent: set[str] = set()  # environments whose evaluate() reported nothing
        self.on = cfg.eval.on
        self.wandb: EvalRun | None = None  # launch.wandb: the group's eval run, opened at the first row
        self.wandb_off = not cfg.launch.wandb

    def start(self) -> None:
        if self.on and self.cfg.eval.at_start:
            self._begin(step_target(0, 0, self.run_dir))

    def on_row(self, row: dict[str, Any]) -> None:
        step, version = row.get("step"), row.get("policy_version")
        if not self.on or not isinstance(step, int) or not isinstance(version, int):
            return
        if step % self.cfg.eval.every_steps or step >= self.cfg.rollout.num_steps or not self._todo(step):
            return  # the last step is the end's evaluation (finish)
        target = step_target(step, version, self.run_dir)
        if self.running is None:
            self._begin(target)
            return
        if self.waiting is not None:
            why = f"step {step} came due while it waited for {self.running.target.label}"
            for spec in self._todo(self.waiting.step):
                self._skip(self.waiting, spec, why)
        self.waiting = target

    def poll(self) -> None:
        if self.running is not None and self.running.done():
            self._record(self.running.result())
        if self.running is None and self.waiting is not None:
            target, self.waiting = self.waiting, None
            self._begin(target)

    def finish(self, last: dict[str, Any] | None) -> None:
        """After the last step: finish what runs and waits, then evaluate the final policy (blocking)."""
        if not self.on:
            return
        while self.running is not None:
            self.poll()
            time.sleep(0.2)
        if not self.cfg.eval.at_end or last is None or not self._todo(last.get("step")):
            return
        print(f"eval: evaluating the final policy (step {last['step']})", flush=True)
        self._begin(step_target(int(last["step"]), int(last["policy_version"]), self.run_dir))
        while self.running is not None:
            self._record(evaluate_now(self.running))

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None
            self.queue = []
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None

    def _log_to_wandb(self, row: dict[str, Any]) -> None:
        """The row on the run's W&B group (its eval run). W&B failing to start or log is said once and ends only
        the evaluations' W&B logging: like a failed evaluation, it never stops training."""
        if self.wandb_off or row.get("status") != "ok":
            return
        try:
            if self.wandb is None:
                config = {"eval": self.cfg.eval.model_dump(mode="json"), "envs": [s.name for s in self.specs]}
                self.wandb = EvalRun(self.run_dir, self.cfg.launch.wandb_project, config)
            self.wandb.log(row)
        except Exception as exc:  # W&B's own errors are of many kinds (network, service, usage)
            self.wandb_off = True
            print(f"eval: not logged to W&B from now on: {type(exc).__name__}: {exc}", flush=True)

    def _todo(self, step: Any) -> list[EnvSpec]:
        return [s for s in self.specs if (step, s.name) not in self.done and s.name not in self.silent]

    def _begin(self, target: Target) -> None:
        self.queue = self._todo(target.step)
        self._next(target)

    def _next(self, target: Target) -> None:
        self.running = None
        if self.queue:
            spec = self.queue.pop(0)
            out = self.run_dir / EVAL_DIR
            self.running = Evaluation(self.cfg, spec, self.gateway_url, out, target, self.auth, self.keyed)

    def _skip(self, target: Target, spec: EnvSpec, why: str) -> None:
        row = eval_row(target, spec.name, 0.0, {}, [], why, self.keyed)
        append_row(self.run_dir, {**row, "status": "skipped"})
        print(f"eval: {target.label} on {spec.name} skipped: {why}", flush=True)

    def _record(self, row: dict[str, Any]) -> None:
        assert self.running is not None
        target = self.running.target
        append_row(self.run_dir, row)
        self._log_to_wandb(row)
        if row["status"] == "ok":
            self.done.add((row["step"], row["env"]))
        if row["status"] == NOTHING:
            self.silent.add(row["env"])
            print(
                f"eval: {row['env']}'s evaluate() reported nothing (no evaluate_log or wandb_log call): it has no "
                "eval set here; not evaluated again in this run",
                flush=True,
            )
        else:
            print(line(row), flush=True)
        self._next(target)
