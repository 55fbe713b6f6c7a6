"""The command line of every component of a run, and the config file each one reads. Pure: no process is
started here (git_sha only reads the checkout's revision, for benchmark results). The launcher knows all processes;
each process reads only its own file:
- the trainer RUN_DIR/config.yaml (the whole resolved RunConfig),
- the gateway RUN_DIR/gateway.yaml (its own section, validated by its own model),
- run-api nothing (it is configured by the trainer's /register),
- each environment its own command-line flags.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlcommon.envkeys import env_key
from rlcommon.timeouts import GATEWAY_REQUEST_TIMEOUT_S, model_call_timeout_s
from trainer.orchestration.processes import Component
from trainer.orchestration.slurm import Placement, srun_prefix
from trainer.training.config import ConfigError, RunConfig
from trainer.training.rollout_config import VERIFIERS_PREFIX, EnvSpec
from trainer.training.wandb_group import ENVIRONMENT, TRAINER, current_mode, process_environ

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
RUN_API_APP = (
    "atroposlib.api:app"  # what atroposlib's run-api serves; started through uvicorn to pass a socket
)
# A mixed run's run-api: atroposlib's app with the two routes mixing needs (trainer.orchestration.run_api).
MIXED_RUN_API_APP = "trainer.orchestration.run_api:app"
# verifiers environments run in a venv of their own, which launch.sh builds when one is named
# (environments/verifiers_runner/requirements.txt): verifiers is never installed into or imported by .venv.
VERIFIERS_PY = ROOT / ".venv-verifiers" / "bin" / "python"
VERIFIERS_RUNNER = "environments.verifiers_runner"
# verifiers v1 (verifiers.v1, 0.2 and later) needs openai>=2.54,<3 and its own runner: a venv of its own
# (environments/verifiers_v1_runner/requirements.txt). A vf: file is v1 when a line of it imports verifiers.v1;
# launch.sh's verifiers_v1_file greps for the same pattern to pick the venv it builds.
VERIFIERS_V1_PY = ROOT / ".venv-verifiers-v1" / "bin" / "python"
VERIFIERS_V1_RUNNER = "environments.verifiers_v1_runner"
VERIFIERS_V1_IMPORT = re.compile(r"^[ \t]*(from|import)[ \t]+verifiers\.v1\b", re.MULTILINE)


def is_verifiers_v1(target: str) -> bool:
    """Whether a vf: target (verifiers_target's value) is a verifiers v1 taskset file. Installed ids are v0."""
    path = Path(target)
    return target.endswith(".py") and path.is_file() and bool(VERIFIERS_V1_IMPORT.search(path.read_text()))


def verifiers_runner(target: str) -> tuple[Path, str]:
    """The venv python and the runner module for a vf: target."""
    if is_verifiers_v1(target):
        return VERIFIERS_V1_PY, VERIFIERS_V1_RUNNER
    return VERIFIERS_PY, VERIFIERS_RUNNER


def resolve_env_module(env: str, where: str = "rollout.env") -> list[str]:
    """`python -m environments.<name>` for a built-in name; any Atropos env file runs unmodified through
    environments.upstream (declared flags only, the gateway as its one server, transformers-4 chat ids)."""
    if env.startswith(VERIFIERS_PREFIX):
        # verifiers_target refuses an empty name or a missing file
        python, runner = verifiers_runner(verifiers_target(env, where))
        return [str(python), "-m", runner]
    if env.endswith(".py"):
        path = Path(env)
        if not path.is_file():
            raise ConfigError(f"{where}={env!r}: no such environment file")
        return [PY, "-m", "environments.upstream", str(path.resolve())]
    if env not in builtin_environments():
        names = builtin_environments()
        raise ConfigError(
            f"{where}: unknown environment {env!r}: built-in ones are {names}, or pass a path to an env file"
        )
    return [PY, "-m", f"environments.{env}"]


def builtin_environments() -> list[str]:
    """The environments/ modules that run as an environment (`python -m environments.<name>`): those with a main
    block, not the code they share (environments/common.py)."""
    return sorted(
        p.stem
        for p in (ROOT / "environments").glob("*.py")
        if not p.stem.startswith("_") and 'if __name__ == "__main__"' in p.read_text()
    )


def verifiers_target(env: str, where: str) -> str:
    """What `vf:<target>` names, as the runner's --env.vf_env: an installed environment id, or a .py file made
    absolute (the runner's working folder is the repository's)."""
    target = env.removeprefix(VERIFIERS_PREFIX)
    if not target:
        raise ConfigError(f"{where}={env!r}: name the verifiers environment after vf: (an id or a .py file)")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"{where}={env!r}: no such verifiers environment file {target!r}")
        return str(path.resolve())
    return target


def verifiers_flags(spec: EnvSpec, where: str) -> dict[str, Any]:
    """The runner's own flags: the environment, and env_args as load_environment's keyword arguments."""
    return {"env.vf_env": verifiers_target(spec.env, where), "env.vf_env_args": json.dumps(spec.env_args)}


def env_where(cfg: RunConfig, spec: EnvSpec) -> str:
    """The config key that names this environment, for error messages."""
    if not cfg.rollout.envs:
        return "rollout.env"
    return f"rollout.envs.{[s.name for s in cfg.rollout.env_specs()].index(spec.name)}.env"


def flag(key: str, value: Any) -> str:
    # key=value in one token: atroposlib reads `--flag -1` as a bare boolean flag
    return f"--{key}={json.dumps(value) if isinstance(value, list | dict) else value}"


def env_args_flags(spec: EnvSpec) -> list[str]:
    return [flag(f"env.{k}", v) for k, v in spec.env_args.items()]


def env_command(cfg: RunConfig, model_path: str, worker: int, spec: EnvSpec | None = None) -> list[str]:
    """One environment process (`spec`: one of cfg.rollout.env_specs(); None = the first, rollout.env alone)."""
    r = cfg.rollout
    spec = spec or r.env_specs()[0]
    offpolicy = cfg.env_batches_offpolicy()
    flags: dict[str, Any] = {
        "env.rollout_server_url": cfg.launch.run_api_url,
        "env.group_size": spec.group_size,
        "env.batch_size": r.batch_size,
        "env.max_batches_offpolicy": offpolicy,
        "env.total_steps": -1,  # follow run-api's num_steps (the trainer's registration)
        "env.max_token_length": spec.max_token_length,
        "env.tokenizer_name": model_path,
        # With launch.wandb, Atropos's own W&B logging, in the run's group (wandb_environs gives the process who it
        # is); never without it.
        "env.use_wandb": cfg.launch.wandb,
        "env.seed": r.seed + worker,
        # run-api's desired_name; the trainer reads it back (GET /envs) to name each group's environment
        "env.wandb_name": f"{spec.name}-{worker}",
        "env.temperature": r.temperature,
        "env.max_new_tokens": r.max_new_tokens,
        "openai.base_url": f"{cfg.launch.gateway_url}/v1",
        # The gateway tells environments apart by this key: a mixed run's gate holds each to its own share.
        "openai.api_key": env_key(spec.name),
        "openai.model_name": model_path,
        "openai.tokenizer_name": model_path,
        "openai.server_type": "vllm",
    }
    if r.envs:
        # run-api's own mixing: every batch holds at least this share of its sequences from this environment
        # (whole groups), and the environment paces itself to keep that share queued.
        flags["env.inference_weight"] = spec.weight
        flags["env.min_batch_allocation"] = round(spec.share / spec.workers, 6)
    if spec.is_verifiers:  # env_args are load_environment's, not the runner's flags
        flags.update(verifiers_flags(spec, env_where(cfg, spec)))
        # The runner's own model client waits as long as the gateway may take: the gate's hold, then vLLM.
        gateway_timeout = cfg.inference.get("request_timeout_s", GATEWAY_REQUEST_TIMEOUT_S)
        flags["env.request_timeout_s"] = model_call_timeout_s(cfg.publish.gate_hold_s, gateway_timeout)
        return [
            *resolve_env_module(spec.env, env_where(cfg, spec)),
            "serve",
            *(flag(k, v) for k, v in flags.items()),
        ]
    if "use_wandb" in spec.env_args:
        raise ConfigError(
            f"{env_where(cfg, spec).removesuffix('.env')}.env_args.use_wandb={spec.env_args['use_wandb']!r}: the "
            "launcher sets it from launch.wandb (the environments then log to the run's W&B group); drop it and set "
            "launch.wandb=true or false"
        )
    for key in spec.env_args:  # the environment's env_args win over what the launcher derives
        flags.pop(f"env.{key}", None)
    own = [f"--user-keys={','.join(spec.env_args)}"] if spec.is_file else []  # environments.upstream's
    return [
        *resolve_env_module(spec.env, env_where(cfg, spec)),
        "serve",
        *(flag(k, v) for k, v in flags.items()),
        *env_args_flags(spec),
        *own,
    ]


def env_preflight_command(cfg: RunConfig, model_path: str, spec: EnvSpec | None = None) -> list[str] | None:
    """The environment's own check of what it needs, run before anything starts. An env file gets
    environments.upstream's (declared flags, its setup() and prompt lengths against the run's limits); a
    built-in one its `preflight` function (e.g. gsm8k's data), or None when it has none. Read from its source, not
    imported: an environment process starts in seconds (atroposlib), which a launch should spend only when there
    is something to check."""
    spec = spec or cfg.rollout.env_specs()[0]
    # an unknown environment is a ConfigError naming the known ones
    module = resolve_env_module(spec.env, env_where(cfg, spec))
    if spec.is_verifiers:
        python, _ = verifiers_runner(verifiers_target(spec.env, env_where(cfg, spec)))
        if not python.is_file():
            setup = "--setup-verifiers-v1" if python == VERIFIERS_V1_PY else "--setup-verifiers"
            raise ConfigError(
                f"{env_where(cfg, spec)}={spec.env!r}: the verifiers venv {python.parent.parent} is missing; "
                f"launch.sh builds it when a vf: environment is named (or: bash launch.sh {setup})"
            )
        own = verifiers_flags(spec, env_where(cfg, spec)) | {"env.tokenizer_name": model_path}
        # The v0 runner checks a tool environment against the flags vLLM starts with (a parser or a 400 per request).
        if cfg.launch.backend == "local" and python == VERIFIERS_PY:
            own["env.vllm_extra_args"] = json.dumps((cfg.inference.get("vllm") or {}).get("extra_args") or [])
        return [*module, "preflight", *(flag(k, v) for k, v in own.items())]
    if spec.is_file:
        flags = [
            a for a in env_command(cfg, model_path, 0, spec)[len(module) + 1 :] if not a.endswith("=None")
        ]
        limits = [f"--max-seq-len={cfg.trainer.max_seq_len}"]
        max_model_len = (cfg.inference.get("vllm") or {}).get("max_model_len")
        if max_model_len:
            limits.append(f"--max-model-len={max_model_len}")
        return [*module, "preflight", *flags, *limits]
    source = (ROOT / "environments" / f"{spec.env}.py").read_text()
    if not any(isinstance(n, ast.FunctionDef) and n.name == "preflight" for n in ast.parse(source).body):
        return None
    return [*module, "preflight", *env_args_flags(spec)]


def env_share_lines(cfg: RunConfig) -> list[str]:
    """For the dry run: what each environment is allotted of a batch, in sequences and groups."""
    batch = cfg.rollout.batch_size
    lines = []
    for spec in cfg.rollout.env_specs():
        seqs = spec.batch_sequences(batch)
        lines.append(
            f"environment {spec.name}: weight {spec.weight:g}, share {spec.share:.3f}: run-api fills {seqs} of "
            f"each batch's {batch} sequences from it first ({seqs // spec.group_size} groups of {spec.group_size}), "
            f"{spec.workers} process(es)"
        )
    staleness = cfg.rollout.max_staleness
    if staleness < 2 and cfg.share_quota():
        gate = " with the on-policy gate" if cfg.publish.gate_on(staleness) else ""
        lines.append(
            f"rollout.max_staleness={staleness}{gate}: the gateway lets each environment start only its share of a "
            "batch per version, so the group atroposlib keeps beyond it waits for the next one"
        )
    elif staleness < 2:
        lines.append(
            f"rollout.max_staleness={staleness} with publish.gate_quota off: atroposlib keeps one group per "
            "environment beyond its share, trained a batch later; below 2 that group is dropped as stale at every "
            "step (leave publish.gate_quota on, or set rollout.max_staleness to 2 or more)"
        )
    return lines


def trainer_command(
    cfg: RunConfig, config_file: str, rendezvous: str | None = None, run_id: str = "rl"
) -> list[str]:
    """`python -m trainer run`, under torchrun when the config asks for several data-parallel ranks.
    `rendezvous` (host:port of the first trainer node) is needed only when the trainer spans nodes."""
    d = cfg.distributed
    run = ["-m", "trainer", "run", "--config", config_file]
    if d.world_size == 1:
        return [PY, *run]
    argv = [PY, "-m", "torch.distributed.run", f"--nproc_per_node={d.nproc_per_node}", f"--nnodes={d.nnodes}"]
    if d.nnodes == 1:
        argv.append("--standalone")
    elif rendezvous is None:
        raise ConfigError(
            f"distributed.nnodes={d.nnodes}: a trainer across nodes needs SLURM (sbatch launch.sh)"
        )
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}", f"--rdzv-id={run_id}"]
    return argv + run


def server_argvs(
    cfg: RunConfig, run_dir: Path, placement: Placement | None, fds: dict[str, int]
) -> dict[str, list[str]]:
    """run-api and the gateway: on an inherited socket (--fd) locally, on the job's derived ports under SLURM."""
    logs = run_dir / "logs"
    gateway = [PY, "-m", "inference", "--config", str(run_dir / "gateway.yaml"), "--log-dir", str(logs)]
    run_api = [PY, "-m", "uvicorn", MIXED_RUN_API_APP if cfg.rollout.envs else RUN_API_APP]
    if (
        cfg.rollout.envs
    ):  # how long one environment's share may hold a batch (trainer/orchestration/run_api.py)
        run_api = ["env", f"RUN_API_MIX_WAIT_S={cfg.rollout.mix_wait_s}", *run_api]
    if placement is None:
        return {
            "run-api": [*run_api, "--fd", str(fds.get("run-api", "<fd>"))],
            "gateway": [*gateway, "--fd", str(fds.get("gateway", "<fd>"))],
        }
    # Under SLURM the gateway binds inference.host:inference.port itself (both are in its gateway.yaml).
    return {
        "run-api": [*run_api, "--host", placement.bind_host, "--port", str(placement.ports.run_api)],
        "gateway": gateway,
    }


def trainer_allocator_env(cfg: RunConfig, environ: Mapping[str, str]) -> list[str]:
    """The trainer's CUDA allocator setting, unless the user chose one (PYTORCH_ALLOC_CONF is the newer name torch
    also reads) or the trainer runs on CPU. Expandable segments keep the trainer's reserved memory near its planned
    peak instead of growing with fragmentation, and let freed memory go back to the driver: a vLLM restarted after a
    crash refuses to start unless its whole --gpu-memory-utilization share is free beside the trainer."""
    if cfg.model.device == "cpu" or "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return []
    return ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def wandb_environs(cfg: RunConfig, run_dir: Path) -> dict[str, dict[str, str]]:
    """The W&B environment variables of the trainer and of each environment process (launch.wandb=true), by
    component name: one mode for all, decided here once (WANDB_MODE if set, else online with a W&B login,
    offline without)."""
    mode, project = current_mode(), cfg.launch.wandb_project
    out = {"trainer": process_environ(run_dir, "trainer", TRAINER, project, mode)}
    for name, _, _ in cfg.rollout.env_processes():
        out[name] = process_environ(run_dir, name, ENVIRONMENT, project, mode)
    return out


def build_components(
    cfg: RunConfig,
    run_dir: Path,
    model_path: str,
    placement: Placement | None = None,
    job_id: int = 0,
    fds: dict[str, int] | None = None,
) -> list[Component]:
    """The run's processes in start order. With a SLURM placement each one is an srun step on its node(s)."""
    fds = fds or {}
    argvs = server_argvs(cfg, run_dir, placement, fds)
    for name, spec, w in cfg.rollout.env_processes():
        argvs[name] = env_command(cfg, model_path, w, spec)
    rendezvous = f"{placement.hosts['trainer'][0]}:{placement.ports.rendezvous}" if placement else None
    argvs["trainer"] = trainer_command(cfg, str(run_dir / "config.yaml"), rendezvous, str(job_id))
    trainer_env = trainer_allocator_env(cfg, os.environ)
    if cfg.distributed.devices:
        # Inside the command, not srun's environment: slurmstepd rewrites CUDA_VISIBLE_DEVICES for GPU steps.
        trainer_env.append(f"CUDA_VISIBLE_DEVICES={cfg.distributed.devices}")
    if trainer_env:
        argvs["trainer"] = ["env", *trainer_env, *argvs["trainer"]]
    environs = wandb_environs(cfg, run_dir) if cfg.launch.wandb else {}
    components = []
    for name, argv in argvs.items():
        if placement is not None:
            argv = [*srun_prefix(name, placement.hosts[name], job_id), *argv]
        # run-api gets an empty cwd: it must not watch our files.
        components.append(
            Component(
                name,
                argv,
                run_dir / "logs" / f"{name}.log",
                cwd=run_dir / "run-api" if name == "run-api" else ROOT,
                env=environs.get(name, {}),
                slurm_job=job_id if placement is not None else None,
                pass_fds=(fds[name],) if name in fds else (),
            )
        )
    return components


def git_sha() -> str:
    """The checkout's short revision, for the JSON a benchmark prints ("unknown" outside git)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
