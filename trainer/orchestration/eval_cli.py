"""`python -m trainer eval`: evaluate the base model and any saved adapters on an environment's eval set, together
on one gateway (up to --jobs at once, one environment after another), and print how each differs from the first.

    python -m trainer eval RUN_DIR                           # the base model, then the run's newest adapter
    python -m trainer eval RUN_DIR --version 10 --version 30 # adapters/v10 and v30 of the run (add --base for it)
    python -m trainer eval --config configs/toy.yaml --base --adapter path/to/peft_folder [key=value ...]
    python -m trainer eval RUN_DIR --gateway http://127.0.0.1:PORT   # use a running gateway (same base model)
    python -m trainer eval RUN_DIR --env gsm8k --env path/to/env.py   # other environments' eval sets

The environment and the eval settings (eval.k, eval.temperature, eval.max_items, eval.max_new_tokens) come from the
run's config.yaml or --config, with dotted overrides (`eval.k=4 eval.temperature=1.0`). Without --gateway, a gateway
and its vLLM are started for the command and stopped after it. Writes a JSON file (--out) with every row and the
differences.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainer.orchestration.commands import resolve_env_module
from trainer.orchestration.evaluation import BASE, Evaluation, Target
from trainer.orchestration.preflight import check_model
from trainer.training.checkpoints import VERSION_DIR, adapter_dir, write_atomic
from trainer.training.config import ConfigError, RunConfig, load_config
from trainer.training.rollout_config import EnvSpec

SHOWN = ("eval/pass@1", "eval/reward/mean", "eval/items")
MAX_COLUMNS = 6
NOT_COMPARED = ("eval/items", "eval/samples_per_item", "eval/failed_items")  # counts, not scores
# Each evaluation is a process importing its environment (atroposlib, transformers: seconds of CPU) and then mostly
# waits on the gateway, whose vLLM batches their requests together.
MAX_JOBS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", nargs="?", help="a run folder (its config.yaml and adapters/)")
    p.add_argument("--config", help="a run config, when no run folder is given (or to replace its config)")
    p.add_argument(
        "--version", type=int, action="append", default=[], help="the run's adapters/vN (repeatable)"
    )
    p.add_argument("--adapter", action="append", default=[], help="a PEFT adapter folder (repeatable)")
    p.add_argument("--base", action="store_true", help="evaluate the base model too (first)")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        help="evaluate on this environment (a built-in name or an env file; repeatable) instead of the config's",
    )
    p.add_argument("--gateway", help="URL of a running gateway serving the same base model")
    p.add_argument("--out", help="JSON file to write (default: <folder>/eval-<time>.json)")
    p.add_argument(
        "--jobs",
        type=int,
        default=min(MAX_JOBS, os.cpu_count() or 1),
        help=f"evaluations at once, each a process of its own sampling the same gateway (default: the CPU count, "
        f"at most {MAX_JOBS})",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (eval.k=4 ...)")
    return p.parse_args(argv)


def newest_version(run_dir: Path) -> int | None:
    found = [int(m.group(1)) for p in (run_dir / "adapters").glob("v*") if (m := VERSION_DIR.match(p.name))]
    return max(found) if found else None


def targets_of(args: argparse.Namespace, run_dir: Path | None) -> list[Target]:
    """In the order given, the base model first when asked (or by default for a run folder)."""
    adapters: list[tuple[Path, int | None]] = []
    if run_dir is not None:
        versions = args.version
        if not versions and not args.adapter:
            newest = newest_version(run_dir)
            if newest is None:
                raise ConfigError(f"{run_dir}/adapters holds no vN folder: nothing was published in that run")
            versions = [newest]
        adapters += [(adapter_dir(run_dir, v), v) for v in versions]
    elif args.version:
        raise ConfigError("--version N needs a run folder: python -m trainer eval RUN_DIR --version N")
    adapters += [(Path(a).resolve(), None) for a in args.adapter]
    for path, _ in adapters:
        if not (path / "adapter_config.json").is_file():
            raise ConfigError(f"{path} is not a PEFT adapter folder (no adapter_config.json)")
    base = args.base or (run_dir is not None and not args.version and not args.adapter)
    targets = [Target(BASE)] if base else []
    # Names must not contain "/v1": atroposlib derives /generate from the base URL by removing it.
    targets += [Target(f"cmp-{i}", path, None, version) for i, (path, version) in enumerate(adapters)]
    if not targets:
        raise ConfigError("nothing to evaluate: give --base, --adapter PATH or a run folder")
    return targets


def resolve(args: argparse.Namespace) -> tuple[RunConfig, Path | None, Path | None]:
    """(config, run folder, the config file a gateway would be started from)."""
    run_dir = Path(args.run_dir).resolve() if args.run_dir else None
    config = args.config or (str(run_dir / "config.yaml") if run_dir else None)
    if run_dir is not None and not (run_dir / "config.yaml").is_file() and not args.config:
        raise ConfigError(f"{run_dir} has no config.yaml: is it a run folder? (or pass --config FILE)")
    if config is None:
        raise ConfigError("give a run folder or --config FILE (the environment and model to evaluate)")
    cfg = load_config(RunConfig, config, args.overrides)
    if cfg.launch.backend != "local":
        raise ConfigError("python -m trainer eval samples through a local gateway: set launch.backend=local")
    cfg.model.path = check_model(cfg.model.path)
    return cfg, run_dir, Path(config)


@contextlib.contextmanager
def gateway(
    args: argparse.Namespace, cfg: RunConfig, config: Path, log_dir: Path, slots: int
) -> Iterator[tuple[str, dict[str, str]]]:
    """The URL and auth header of the gateway to use: the one given, or one started for this command with `slots`
    LoRA slots for adapters loaded by name (those evaluated at once)."""
    token = cfg.inference.get("publish_token")
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    if args.gateway:
        yield args.gateway.rstrip("/"), auth
        return
    from trainer.orchestration.gateway_process import spawn_gateway

    print(f"starting a gateway and vLLM for the evaluation (logs: {log_dir})", flush=True)
    with spawn_gateway(str(config), [*args.overrides, f"inference.named_slots={slots}"], log_dir) as (url, _):
        yield url, auth


def evaluate_together(
    start: Callable[[Target], Evaluation], targets: list[Target], jobs: int
) -> list[dict[str, Any]]:
    """Each target's row, in the targets' order, with up to `jobs` evaluations running at once. The targets are
    distinct names, so no two running evaluations load or unload the same adapter. An interruption stops the
    evaluations still running."""
    rows: dict[int, dict[str, Any]] = {}
    running: dict[int, Evaluation] = {}
    pending = list(enumerate(targets))
    try:
        while pending or running:
            while pending and len(running) < jobs:
                i, target = pending.pop(0)
                running[i] = start(target)
            for i, ev in list(running.items()):
                if ev.done():
                    rows[i] = ev.result()
                    del running[i]
            if running:
                time.sleep(0.2)
    finally:
        for ev in running.values():
            ev.stop()
    return [rows[i] for i in range(len(targets))]


def table(rows: list[dict[str, Any]]) -> str:
    """The standard columns when the environment reports them (pass@k, reward, items), else up to MAX_COLUMNS of
    what it reported."""
    keys = [k for k in SHOWN if any(k in r for r in rows)]
    keys += sorted({k for r in rows for k in r if k.startswith("eval/pass@") and k not in keys})
    if not keys:
        reported = {k for r in rows for k in r if k.startswith("eval/") and k not in NOT_COMPARED}
        keys = sorted(reported)[:MAX_COLUMNS]
    head = ["target", *(k.removeprefix("eval/") for k in keys), "seconds", "status"]

    def shown(key: str, value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.0f}" if key.endswith("items") else f"{value:.3f}"

    body = [
        [
            str(r["target"]),
            *(shown(k, r.get(k)) for k in keys),
            f"{r['seconds']:.1f}",
            r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in [head, *body]
    )


def env_specs(cfg: RunConfig, envs: list[str]) -> list[EnvSpec]:
    """The environments to evaluate on: the config's (every one of a mixed run), or those asked for; one asked for
    that the config does not hold gets no env_args (they are another environment's flags)."""
    known = {s.env: s for s in cfg.rollout.env_specs()}
    if not envs:
        return list(known.values())
    out = []
    for env in envs:
        resolve_env_module(
            env
        )  # an unknown name or a missing file is a ConfigError now, not in a process later
        out.append(
            known.get(env)
            or EnvSpec(
                Path(env).stem, env, 1.0, 1.0, {}, cfg.rollout.group_size, cfg.rollout.max_token_length, 1
            )
        )
    return out


def differences(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each later target's metrics minus the first target's (the base model when it was evaluated), on one
    environment."""
    if len(rows) < 2 or rows[0]["status"] != "ok":
        return {}
    first = rows[0]
    out = {}
    for r in rows[1:]:
        if r["status"] == "ok":
            out[str(r["target"])] = {
                k: r[k] - first[k]
                for k in r
                if k.startswith("eval/") and k not in NOT_COMPARED and isinstance(first.get(k), int | float)
            }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg, run_dir, config = resolve(args)
        targets = targets_of(args, run_dir)
        specs = env_specs(cfg, args.env)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assert config is not None
    if args.jobs < 1:
        print(f"error: --jobs={args.jobs}: give 1 or more (evaluations at once)", file=sys.stderr)
        return 2
    slots = max(1, min(args.jobs, sum(1 for t in targets if t.adapter is not None)))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = (run_dir or Path("runs").resolve()) / "eval" / f"compare-{stamp}"
    folder.mkdir(parents=True, exist_ok=True)
    by_env: dict[str, list[dict[str, Any]]] = {}
    try:
        with gateway(args, cfg, config, folder / "logs", slots) as (url, auth):
            for spec in specs:

                def start(target: Target, spec: EnvSpec = spec) -> Evaluation:
                    print(f"evaluating {target.label} on {spec.name}", flush=True)
                    return Evaluation(cfg, spec, url, folder, target, auth)

                by_env[spec.name] = evaluate_together(start, targets, args.jobs)
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rows = [r for env_rows in by_env.values() for r in env_rows]
    diffs = {env: differences(env_rows) for env, env_rows in by_env.items()}
    for env, env_rows in by_env.items():
        print(f"\n{env}:\n{table(env_rows)}")
        for label, delta in diffs[env].items():
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:+.3f}" for k, v in delta.items())
            print(f"{label} vs {env_rows[0]['target']}: {shown}")
    out = Path(args.out) if args.out else folder.with_suffix(".json")
    command = "python -m trainer eval " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    write_atomic(out, json.dumps({"command": command, "rows": rows, "differences": diffs}, indent=2))
    print(f"written: {out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
