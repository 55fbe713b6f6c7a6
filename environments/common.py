"""Pieces every built-in environment shares: the gateway server config, the scored group built from
ManagedServer nodes, held-out evaluation and what it reports, and the process entry point. Imports atroposlib;
nothing here talks to the trainer."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import httpx
from atroposlib.envs.base import APIServerConfig, BaseEnv, ScoredDataGroup
from pydantic import BaseModel, Field, ValidationError

from environments.evaluation import eval_metrics, run_items
from rlcommon.timeouts import model_call_timeout_s

log = logging.getLogger("environments")

WANDB_LOG_FILE = "wandb_log.jsonl"


class ModelCallSettings(BaseModel):
    """The timeout of an environment's own model client (the verifiers runners'), which the launcher sets from the
    run's gate hold and gateway request timeout."""

    request_timeout_s: float = Field(
        model_call_timeout_s(),
        gt=0,
        description="how long one model call through the gateway may take: publish.gate_hold_s, then "
        "inference.request_timeout_s, plus slack (the launcher passes the run's)",
    )


def verifiers_preflight_start(flags: dict[str, str], module: str, what: str) -> tuple[str, Any, list[str]]:
    """The start of a verifiers runner's pre-flight: the environment's name, its arguments, and what is wrong so far
    (arguments that are not JSON; `module` not importable here, for `what` kind of environment)."""
    name = flags.get("vf_env", "")
    try:
        args = json.loads(flags.get("vf_env_args", "{}"))
    except json.JSONDecodeError as exc:
        return name, None, [f"rollout.env_args of {name!r} are not JSON: {exc}"]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return (
            name,
            args,
            [f"{module} is not importable here ({exc}); launch.sh builds its venv when {what} is named"],
        )
    return name, args, []


def gateway_servers() -> list[APIServerConfig]:
    """One gateway server, as a list: atroposlib rewrites a bare APIServerConfig to localhost:9004-9007.
    launch.sh overrides the URL and model with --openai.* flags."""
    return [
        APIServerConfig(
            model_name="policy", base_url="http://127.0.0.1:9000/v1", api_key="local", server_type="vllm"
        )
    ]


def completion_ids(node: Any) -> list[int]:
    return [t for t in node.masked_tokens if t != -100]


def group_from_nodes(nodes: Sequence[Any], scores: Sequence[float]) -> ScoredDataGroup:
    """The group run-api receives: ManagedServer's tokens, -100 prompt masks and aligned sampler logprobs."""
    group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
    for node, score in zip(nodes, scores, strict=True):
        group["tokens"].append(node.tokens)
        group["masks"].append(node.masked_tokens)
        group["inference_logprobs"].append(node.logprobs)
        group["scores"].append(float(score))
    return group


class ResumableData(BaseEnv):
    """Keeps an environment's place in its data across restarts, through Atropos's own env checkpoints: saved
    with each trainer checkpoint interval, and loaded by a (re)started environment from the newest one at or
    before the step run-api registers it at (Atropos itself loads only an exact step match, and names the folder
    after the registration count, which changes when an environment is restarted)."""

    data_position: tuple[str, ...] = ()  # attributes that hold the place, e.g. ("index",)
    # Set by run_cli's `evaluate` command: setup() may skip what only training needs (gsm8k's training split).
    evaluate_only: ClassVar[bool] = False
    # config_init's defaults, which the launcher's --env.* flags override.
    default_group_size: ClassVar[int] = 8
    default_max_token_length: ClassVar[int] = 2048

    @classmethod
    def config_init(cls) -> tuple[Any, list[APIServerConfig]]:
        """The environment's config (named after it, no W&B, no Atropos-side eval) and the gateway as its server.
        ensure_scores_are_not_same is off: equal-reward groups reach the trainer, which counts and skips them, so
        reward/mean is the reward of every rollout, not of the mixed groups only."""
        env = cls.env_config_cls(
            wandb_name=cls.name,
            group_size=cls.default_group_size,
            use_wandb=False,
            steps_per_eval=0,
            max_token_length=cls.default_max_token_length,
            ensure_scores_are_not_same=False,
        )
        return env, gateway_servers()

    def _position_folder(self) -> Path:
        return Path(self.checkpoint_dir) / "env_checkpoints" / str(self.config.wandb_name)

    def save_checkpoint(self, step: int, data: dict[str, Any] | None = None) -> None:
        position = {**(data or {}), **{key: getattr(self, key) for key in self.data_position}}
        folder = self._position_folder()
        folder.mkdir(parents=True, exist_ok=True)
        sweep_cut_writes(folder)
        tmp = folder / f".step-{step}.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(position))
        tmp.replace(folder / f"step-{step}.json")

    def load_checkpoint(self) -> None:
        sweep_cut_writes(self._position_folder())
        saved = []
        for path in self._position_folder().glob("step-*.json"):
            match = re.fullmatch(r"step-(\d+)\.json", path.name)
            if match and int(match.group(1)) <= self.curr_step:
                saved.append((int(match.group(1)), path))
        if not saved:
            return
        step, path = max(saved)
        for key, value in json.loads(path.read_text()).items():
            setattr(self, key, value)
        logging.getLogger(__name__).info("resumed the data position of step %d: %s", step, path.read_text())


def sweep_cut_writes(folder: Path) -> None:
    """Remove the temporary files of position writes another process of this environment was killed in (only one
    runs at a time: the launcher restarts it once the last is gone); this process's own are its to finish."""
    mine = f".tmp-{os.getpid()}"
    for path in folder.glob(".step-*.json.tmp-*") if folder.is_dir() else []:
        if not path.name.endswith(mine):
            path.unlink(missing_ok=True)


Preflight = Callable[[dict[str, str]], list[str]]


def hub_reachable(timeout_s: float = 5.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        httpx.head(
            os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=timeout_s, follow_redirects=True
        )
        return True
    except httpx.HTTPError:
        return False


def env_flags(argv: Sequence[str]) -> dict[str, str]:
    """`--env.key=value` flags as {key: value} (the launcher passes rollout.env_args this way)."""
    flags = {}
    for arg in argv:
        key, sep, value = arg.removeprefix("--").partition("=")
        if sep and key.startswith("env."):
            flags[key.removeprefix("env.")] = value
    return flags


def run_preflight(check: Preflight | None, argv: Sequence[str]) -> int:
    """`python -m environments.NAME preflight [--env.key=value ...]`: one `preflight: ...` line on stderr per
    problem (what is missing and how to supply it), exit 2 if any."""
    problems = check(env_flags(argv)) if check else []
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    return 2 if problems else 0


def configure_logging() -> None:
    # atroposlib logs at INFO without a handler of its own.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def chat_template_returns_ids() -> None:
    """transformers 5 made `apply_chat_template(..., tokenize=True)` return a BatchEncoding unless the caller
    passes return_dict=False; atroposlib 0.4.0 (tokenize_for_trainer, ~50 upstream environments) was written for
    transformers 4, where it returned the token ids, and its groups then fail to serialise. In an environment
    process only, restore the old default: a caller that names return_dict (or asks for the assistant mask, which
    needs the dict) is left alone."""
    from transformers import PreTrainedTokenizerBase

    original = PreTrainedTokenizerBase.apply_chat_template
    if getattr(original, "_returns_ids", False):
        return

    def apply_chat_template(self: Any, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        if "return_dict" not in kwargs and not kwargs.get("return_assistant_tokens_mask"):
            kwargs["return_dict"] = False
        return original(self, conversation, *args, **kwargs)

    apply_chat_template._returns_ids = True  # type: ignore[attr-defined]
    PreTrainedTokenizerBase.apply_chat_template = apply_chat_template  # type: ignore[method-assign]


Sampled = tuple[float, dict[str, Any]]  # one eval sample: its reward, and a record for samples.jsonl


async def evaluate_items(
    env: Any,
    items: Sequence[Any],
    sample: Callable[[Any], Awaitable[list[Sampled]]],
    threshold: float,
    task: str,
) -> dict[str, float | int]:
    """A built-in environment's eval: `sample(item)` draws eval_k samples of one item and scores them; the metrics
    (environments.evaluation.eval_metrics) and a few samples go to evaluate_log, i.e. metrics.json and samples.jsonl
    in data_dir_to_save_evals. Items that raise are counted in failed_items; all of them failing raises.

    No wandb_log call: metrics.json is the record the trainer reads and logs to W&B under the run's own keys;
    upstream environments likewise write evaluate_log from evaluate() and leave wandb_log to the serve loop."""
    cfg = env.config
    limit = cfg.eval_max_items
    chosen = list(items[:limit] if limit else items)
    start = time.time()
    outcome = await run_items(chosen, sample)
    metrics = eval_metrics(
        [[reward for reward, _ in samples] for samples in outcome.results],
        threshold,
        cfg.eval_k,
        failed_items=len(outcome.failures),
    )
    records = [
        {**record, "reward": reward} for samples in outcome.results[:4] for reward, record in samples[:2]
    ]
    await env.evaluate_log(
        metrics,
        task_name=task,
        start_time=start,
        end_time=time.time(),
        generation_parameters={
            "temperature": cfg.eval_temperature,
            "max_new_tokens": eval_max_new_tokens(cfg),
            "n": cfg.eval_k,
        },
        samples=records,
        verbose=False,
    )
    log.info("eval %s: %s", task, json.dumps(metrics))
    return metrics


def eval_max_new_tokens(cfg: Any) -> int:
    return int(cfg.eval_max_new_tokens or cfg.max_new_tokens)


def json_safe(metrics: Any) -> dict[str, Any]:
    """The numbers and strings of a wandb_log dict (numpy scalars as Python numbers); tables, media, lists and
    non-finite numbers are left out."""
    if not isinstance(metrics, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, str | bool):
            out[str(key)] = value
        elif isinstance(value, numbers.Integral):
            out[str(key)] = int(value)
        elif isinstance(value, numbers.Real) and math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out


def append_report(folder: str | None, metrics: Any) -> None:
    line = json_safe(metrics)
    if not line:
        return
    if folder is None:
        log.warning("wandb_log metrics not captured: data_dir_to_save_evals is unset")
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / WANDB_LOG_FILE, "a") as out:
        out.write(json.dumps(line) + "\n")


def capturing_wandb_log(original: Callable[..., Awaitable[Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """BaseEnv.wandb_log that first appends the dict it is given to <data_dir_to_save_evals>/wandb_log.jsonl.
    Wrapping the base method catches an environment's own override too, which ends in super().wandb_log(...)."""

    async def wandb_log(self: Any, wandb_metrics: dict[str, Any] | None = None) -> Any:
        append_report(getattr(self.config, "data_dir_to_save_evals", None), wandb_metrics)
        return await original(self, wandb_metrics)

    wandb_log._captures = True  # type: ignore[attr-defined]
    return wandb_log


def flushing_run_evaluate(original: Callable[..., Awaitable[Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """BaseEnv._run_evaluate (setup, then evaluate) followed by one wandb_log call when the environment left eval
    metrics in its `eval_metrics` buffer: upstream environments fill it in evaluate() for the serve loop's next
    wandb_log, which an evaluate run never reaches."""

    async def _run_evaluate(self: Any) -> Any:
        result = await original(self)
        buffered = getattr(self, "eval_metrics", None)
        if isinstance(buffered, list) and buffered:
            try:
                await self.wandb_log()
            except Exception as exc:  # metrics.json is already written; a failing W&B flush must not void it
                log.warning(
                    "flushing the eval_metrics buffer through wandb_log failed: %s: %s",
                    type(exc).__name__,
                    exc,
                )
        return result

    return _run_evaluate


@contextlib.contextmanager
def capturing_reports() -> Iterator[None]:
    """For an `evaluate` run: what the environment reports through wandb_log (directly, or buffered in
    eval_metrics) also lands in data_dir_to_save_evals, whether or not W&B is on; the file is never edited."""
    original_log, original_run = BaseEnv.wandb_log, BaseEnv._run_evaluate
    if getattr(original_log, "_captures", False):
        yield
        return
    BaseEnv.wandb_log = capturing_wandb_log(original_log)  # type: ignore[method-assign]
    BaseEnv._run_evaluate = flushing_run_evaluate(original_run)  # type: ignore[method-assign]
    try:
        yield
    finally:
        BaseEnv.wandb_log = original_log  # type: ignore[method-assign]
        BaseEnv._run_evaluate = original_run  # type: ignore[method-assign]


def unprefixed_wandb_log(original: Callable[..., Awaitable[Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """BaseEnv.wandb_log without atroposlib's `<registered name>_` key prefix (e.g. `toy-0_0_`). The launcher gives
    each environment process a W&B run of its own in the run's group, which names it already; the prefix also
    holds run-api's registration count, so keys would change at each restart of the process (`toy-0_1_...`) inside
    the same W&B run, and the processes of one environment would never share a chart."""

    async def wandb_log(self: Any, wandb_metrics: dict[str, Any] | None = None) -> Any:
        # Only this coroutine reads wandb_prepend meanwhile: atroposlib's env_step_checks saves its checkpoint
        # (the other reader) before it logs.
        prefix, self.wandb_prepend = self.wandb_prepend, None
        try:
            return await original(self, wandb_metrics)
        finally:
            self.wandb_prepend = prefix

    wandb_log._unprefixed = True  # type: ignore[attr-defined]
    return wandb_log


@contextlib.contextmanager
def wandb_run_per_process() -> Iterator[None]:
    """For a `serve` run: what the environment logs to W&B (with launch.wandb) goes under atroposlib's own keys
    (train/completion_lengths, train_perf/..., server/...) and the environment's, unprefixed."""
    original = BaseEnv.wandb_log
    if getattr(original, "_unprefixed", False):
        yield
        return
    BaseEnv.wandb_log = unprefixed_wandb_log(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        BaseEnv.wandb_log = original  # type: ignore[method-assign]


def eval_target_problem(argv: Sequence[str], timeout_s: float = 10.0) -> str | None:
    """Why the gateway cannot serve this evaluate process, or None. atroposlib polls <base_url minus /v1>/health and
    holds every request until it answers 200, so a target the gateway does not have (an adapter not loaded: 404)
    or no gateway at all would wait forever. A refused connection or a 4xx ends the process with the reason; a 5xx
    (a backend restarting) is left to atroposlib's wait."""
    base = next((a.partition("=")[2] for a in argv if a.startswith("--openai.base_url=")), "")
    if not base:
        return None
    url = f"{base.replace('/v1', '')}/health"  # as atroposlib derives it
    try:
        answer = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"cannot reach {url} ({type(exc).__name__}: {exc}): is the gateway running at that address?"
    if 400 <= answer.status_code < 500:
        return f"{url} answered {answer.status_code}: {answer.text[:400]}"
    return None


def run_cli(env_cls: type[BaseEnv], preflight: Preflight | None = None) -> None:
    """`python -m environments.NAME serve|evaluate|preflight ...`; `evaluate` runs setup() and evaluate() once
    (atroposlib's own command) with the reports captured (capturing_reports)."""
    command = sys.argv[1:2]
    if command == ["preflight"]:
        sys.exit(run_preflight(preflight, sys.argv[2:]))
    configure_logging()
    chat_template_returns_ids()
    if command != ["evaluate"]:
        with wandb_run_per_process():
            env_cls.cli()
        return
    problem = eval_target_problem(sys.argv[2:])
    if problem:
        sys.exit(f"evaluate: {problem}")
    if issubclass(env_cls, ResumableData):
        env_cls.evaluate_only = True
    try:
        with capturing_reports():
            env_cls.cli()
    except ValidationError as exc:  # a refused --env.* value: the reason, not atroposlib's traceback
        reasons = [f"{'.'.join(map(str, e['loc'])) or exc.title}: {e['msg']}" for e in exc.errors()]
        sys.exit(f"evaluate: {'; '.join(reasons)}")
