"""Run any Atropos environment file as it is, against this run's gateway and run-api:

    python -m environments.upstream FILE serve [--env.key=value ...] [--openai.key=value ...]
    python -m environments.upstream FILE evaluate [flags as for serve]
    python -m environments.upstream FILE preflight [flags as for serve] [--user-keys=a,b] [--max-seq-len=N]
                                                   [--max-model-len=N]

The file is imported, never edited. Three things stand between an upstream environment and a run here, and this
module settles each one in the environment's own process:
- Flags: launch.sh derives --env.* flags (seed, temperature, ...) that many config classes do not declare, and
  atroposlib's parser stops at an unknown flag. `serve` passes only the fields the config class declares and logs
  the rest; `preflight` refuses undeclared keys the user set (rollout.env_args) before anything starts.
- Server configs: atroposlib sends a single APIServerConfig or a ServerBaseline to localhost:9004-9007 (or to
  SLURM nodes on ports 9000+), and refuses --openai.* flags when the default is a list of two or more. Whatever the
  environment declares, it gets one server: the gateway (which fans out to vLLM replicas itself), keeping the
  declared timeouts and request limits.
- transformers 5 made apply_chat_template return a BatchEncoding by default; atroposlib 0.4.0 (tokenize_for_trainer
  and the environments written for it) expects the token list of transformers 4 (environments.common).

`evaluate` runs the file's own setup() and evaluate() once (atroposlib's evaluate command, with the same flag and
server handling as serve); what it reports through wandb_log, directly or buffered in `eval_metrics`, is also written
to <data_dir_to_save_evals>/wandb_log.jsonl beside evaluate_log's metrics.json (environments.common.capturing_reports).

`preflight` (environments/upstream/probe.py) also runs the environment's own setup() and builds a few prompts against a recording stand-in server,
so a prompt that cannot fit the limits, missing data or a missing package is reported in seconds, not found after
an idle hour.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.common import capturing_reports, env_flags, wandb_run_per_process

log = logging.getLogger("environments.upstream")

ENV_PREFIX = "env."
OPENAI_PREFIX = "openai."


class EnvFileError(Exception):
    """The file cannot be run here; the message says what to do."""


def main_class_name(source: str) -> str | None:
    """`X` in the file's `if __name__ == "__main__": X.cli()`: the class the file itself runs."""
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)):
            continue
        for call in ast.walk(node):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "cli"
                and isinstance(call.func.value, ast.Name)
            ):
                return call.func.value.id
    return None


def module_name_for(path: Path) -> tuple[str, Path]:
    """The dotted name the file imports under, and the folder to put on sys.path: inside a package (folders with
    __init__.py) the file is imported as part of it, so its relative imports work; otherwise under its own name, its
    folder first on sys.path, as `python FILE` would."""
    parts, folder = [path.stem], path.parent.resolve()
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts), folder


def load_env_class(path: Path) -> type[Any]:
    """Import the file and return the environment class it runs."""
    from atroposlib.envs.base import BaseEnv

    if not path.is_file():
        raise EnvFileError(f"rollout.env={str(path)!r}: no such file")
    source = path.read_text()
    name, root = module_name_for(path)
    taken = sys.modules.get(name.split(".")[0])
    if taken is not None and not str(getattr(taken, "__file__", "") or "").startswith(str(root)):
        raise EnvFileError(
            f"{path} would import as {name!r}, a name this process already uses ({taken.__name__}); rename the "
            "file or its package folder"
        )
    sys.path.insert(0, str(root))
    if name != path.stem:
        sys.path.insert(0, str(path.parent.resolve()))  # sibling imports by bare name still work
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise EnvFileError(
            f"{path.name} imports {exc.name!r}, which is not installed in this environment: install the package "
            "that provides it into .venv (the environment's README or requirements name it)"
        ) from exc
    except Exception as exc:
        raise EnvFileError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    wanted = main_class_name(source)
    if wanted is not None:
        cls = getattr(module, wanted, None)
        if isinstance(cls, type) and issubclass(cls, BaseEnv):
            return cls
    own = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, BaseEnv) and v.__module__ == name
    ]
    if len(own) == 1:
        return own[0]
    found = ", ".join(c.__name__ for c in own) or "none"
    raise EnvFileError(
        f"{path.name}: cannot tell which environment to run (BaseEnv subclasses defined there: {found}); "
        'end the file with `if __name__ == "__main__": YourEnv.cli()`'
    )


def default_config(cls: type[Any]) -> tuple[Any, Any]:
    """config_init's (env config, server configs): the config class atroposlib builds its parser from, whose fields
    are the --env.* keys the environment accepts."""
    return cls.config_init()


@dataclass
class Flags:
    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # env keys the config class does not declare
    options: dict[str, str] = field(default_factory=dict)  # this module's own options (OWN_OPTIONS)

    @property
    def user_keys(self) -> set[str]:
        """The keys the user set in rollout.env_args (the launcher derives the others)."""
        return {k for k in self.options.get("user-keys", "").split(",") if k}


OWN_OPTIONS = ("user-keys", "max-seq-len", "max-model-len")


def split_flags(argv: Sequence[str], fields: set[str]) -> Flags:
    out = Flags()
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if key in OWN_OPTIONS:
            out.options[key] = value
        elif key.startswith(ENV_PREFIX) and key.removeprefix(ENV_PREFIX) not in fields:
            out.dropped.append(key.removeprefix(ENV_PREFIX))
        else:
            out.kept.append(arg)
    return out


def drop_refused(env_config: Any, flags: Flags) -> list[str]:
    """Launcher-derived --env.* values the config class refuses (answer_format's `seed` must be >= 1; the
    launcher derives 0) are not passed, so the environment keeps its own default; a refused value the user set
    stays, for atroposlib to report. Returns one note per flag left out."""
    from pydantic import ValidationError

    notes: list[str] = []
    while True:
        values = {**env_config.model_dump(), **env_flags(flags.kept)}
        try:
            type(env_config).model_validate(values)
            return notes
        except ValidationError as exc:
            refused = {str(e["loc"][0]): e["msg"] for e in exc.errors() if e["loc"]}
        derived = [
            k for k in refused if k not in flags.user_keys and f"--{ENV_PREFIX}{k}=" in " ".join(flags.kept)
        ]
        if not derived:
            return notes
        for key in derived:
            flags.kept = [a for a in flags.kept if not a.startswith(f"--{ENV_PREFIX}{key}=")]
            notes.append(
                f"--env.{key} not passed: {type(env_config).__name__} refuses the launcher's value "
                f"({refused[key]}); the environment's default {getattr(env_config, key)!r} stays"
            )


def declared_servers(default: Any) -> list[Any]:
    return list(default) if isinstance(default, list) else [default]


def describe_servers(default: Any) -> str:
    servers = declared_servers(default)
    urls = [getattr(s, "base_url", None) or "atroposlib's localhost:9004-9007" for s in servers]
    return f"{len(servers)} server(s) ({', '.join(sorted(set(urls)))})"


def gateway_server_configs(
    default_server_configs: Any, openai_config_dict: Any, yaml_config: Any, cli_passed_flags: Any, logger: Any
) -> list[Any]:
    """Stands in for atroposlib's resolve_openai_configs: one APIServerConfig from what the environment declared
    (timeouts, request limits) overridden by the --openai.* flags (the gateway's URL, the model). Always a list, so
    ServerManager uses it as given instead of rewriting it to fixed localhost ports."""
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig

    first = declared_servers(default_server_configs)[0]
    merged = {**(first.model_dump() if first is not None else {})}
    yaml_openai = (yaml_config or {}).get("openai")
    if isinstance(yaml_openai, list) and yaml_openai:
        yaml_openai = yaml_openai[0]
    if isinstance(yaml_openai, dict):
        merged.update(yaml_openai)
    merged.update(
        {
            k.removeprefix(OPENAI_PREFIX): v
            for k, v in (cli_passed_flags or {}).items()
            if k.startswith(OPENAI_PREFIX)
        }
    )
    config = APIServerConfig(**merged)
    log.info(
        "server configs: the environment declares %s; all its requests go to the gateway at %s",
        describe_servers(default_server_configs),
        config.base_url,
    )
    return [config]


@contextlib.contextmanager
def gateway_only() -> Iterator[None]:
    import atroposlib.envs.base as base

    original = base.resolve_openai_configs
    base.resolve_openai_configs = gateway_server_configs
    try:
        yield
    finally:
        base.resolve_openai_configs = original


def serve(path: Path, argv: Sequence[str], command: str = "serve") -> int:
    """atroposlib's `serve` (or `evaluate`) command of the file's environment class, with the declared flags only
    and the gateway as its one server."""
    cls = load_env_class(path)
    env_config, _ = default_config(cls)
    flags = split_flags(argv, set(type(env_config).model_fields))
    for key in flags.dropped:
        log.info("--env.%s not passed: %s's config class does not declare %r", key, cls.__name__, key)
    for note in drop_refused(env_config, flags):
        log.info("%s", note)
    sys.argv = [str(path), command, *flags.kept]
    with gateway_only(), capturing_reports() if command == "evaluate" else wandb_run_per_process():
        cls.cli()
    return 0
