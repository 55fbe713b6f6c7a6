"""The process supervisor behind launch.sh: resolve and validate the run config, write the run folder, start
run-api and the gateway (with vLLM), the environment(s) once the gateway is healthy, and the trainer (while vLLM
boots where the two share no GPU: start_all); then supervise the run (trainer/orchestration/supervisor.py: one line
per step, a component that dies is restarted within launch.max_restarts_per_hour), and stop everything it started
(its own children, by PID/process group) on Ctrl-C, SIGTERM, a death past the restart budget, or the end of the
run; then write the run's report into RUN_DIR/report/ (however the run ended). A resumed run that already reached
its step count exits 0 without starting anything.

    python -m trainer.orchestration.launcher ENV [--backend local|tinker] [--config FILE] [--dry-run]
                                             [--resume RUN_DIR] [k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from rlcommon.hosts import LOOPBACK_HOSTS
from rlcommon.redaction import redact, redact_override
from trainer.orchestration.attach import ATTACH_KEYS, EngineLease, attach_run, write_attached
from trainer.orchestration.commands import (
    PY,
    ROOT,
    build_components,
    env_share_lines,
)
from trainer.orchestration.dashboard_launch import start_dashboard
from trainer.orchestration.preflight import preflight
from trainer.orchestration.processes import Component, listen, stop_all, stop_first
from trainer.orchestration.slurm import Placement, SlurmJob, job_from_env, parse_nodelist, plan
from trainer.orchestration.supervisor import LaunchError, Supervisor, wait_http
from trainer.training import wandb_group
from trainer.training.checkpoints import read_latest
from trainer.training.config import ConfigError, RunConfig, load_config, sampler_dtype
from trainer.training.distill import resolve_teacher, teacher_kind

ANY_HOST = frozenset({"0.0.0.0", "::"})
RUNS = ROOT / "runs"  # a new run's folder goes here unless trainer.output_dir says where


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    if args.resume:
        run_dir = Path(args.resume).resolve()
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(
                f"--resume {args.resume}: no config.yaml there; pass a run folder launch.sh made"
            )
        cfg = load_config(RunConfig, run_dir / "config.yaml", args.overrides)
        cfg.trainer.output_dir = str(run_dir)  # the folder may have moved since the run started
        return cfg, run_dir
    config = Path(args.config) if args.config else ROOT / "configs" / f"{Path(args.env).stem}.yaml"
    if not config.is_file():
        hint = "pass --config FILE (e.g. configs/tiny_cpu.yaml)"
        if not args.config:
            hint = f"there is no {config.relative_to(ROOT)} for this environment; {hint}"
        raise ConfigError(f"no config {config}: {hint}")
    # --backend goes through validation with the rest (RunConfig refuses e.g. Tinker with data-parallel ranks).
    # No ENV argument: the environments the file names (rollout.env or rollout.envs).
    named = [f"rollout.env={args.env}"] if args.env else []
    overrides = [*named, *args.overrides, f"launch.backend={args.backend}"]
    if not any(o.startswith("trainer.output_dir=") for o in args.overrides):
        # A new folder per launch: the recipe's trainer.output_dir (else runs/<env>) with the time appended.
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        stem = recipe_output_dir(config) or RUNS / Path(args.env or config).stem
        overrides.append(f"trainer.output_dir={stem}-{stamp}")
    cfg = load_config(RunConfig, config, overrides)
    if args.env and cfg.rollout.envs:
        raise ConfigError(
            f"{config} names its environments (rollout.envs): drop the ENV argument {args.env!r} "
            f"(bash launch.sh --config {config})"
        )
    run_dir = Path(cfg.trainer.output_dir).resolve()
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"{run_dir} already holds a run; continue it with --resume {run_dir} or choose a new folder"
        )
    cfg.trainer.output_dir = str(run_dir)
    return cfg, run_dir


def recipe_output_dir(config: Path) -> str | None:
    """The trainer.output_dir a recipe file sets (relative to the project), if it sets one."""
    data = yaml.safe_load(config.read_text()) or {}
    value = (data.get("trainer") or {}).get("output_dir") if isinstance(data, dict) else None
    if not isinstance(value, str) or not value:
        return None
    return value if Path(value).is_absolute() else str(ROOT / value)


def gateway_section(cfg: RunConfig, model_path: str, address: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway's config, completed from the run (model folder, versions kept loaded, sampler, the address this
    launch chose) and validated by the gateway's own model in its own interpreter; returned with every default
    filled in. cfg.inference itself stays as the user wrote it (but for vLLM's dtype, resolved for this machine), so
    a resumed run chooses its ports afresh."""
    resolve_sampler_dtype(cfg)
    section = {k: v for k, v in cfg.inference.items() if k not in ATTACH_KEYS} | (address or {})
    # Every version the trainer may still accept stays loaded: the gateway keeps the trainer's window unless told.
    section.setdefault("keep_versions", cfg.rollout.max_staleness)
    if cfg.eval.on:  # the adapter under evaluation is served by name beside the policy window
        section.setdefault("named_slots", 1)
    if cfg.launch.backend == "tinker":
        section["sampler"] = "tinker"
        section.setdefault("model", cfg.model.path)
        section["tinker"] = {
            "base_model": cfg.model.path,
            "tokenizer": cfg.tinker.tokenizer or model_path,
            "timeout_s": cfg.tinker.timeout_s,
            "client_factory": cfg.tinker.client_factory,
        }
    else:
        section.setdefault("model", model_path)
    proc = subprocess.run(
        [PY, "-m", "inference.config", "-"],
        input=yaml.safe_dump(section),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    if proc.returncode != 0:
        raise ConfigError(proc.stderr.strip() or f"python -m inference.config exited with {proc.returncode}")
    return dict(json.loads(proc.stdout))


def place_on_slurm(cfg: RunConfig, job: SlurmJob, preview: bool = False) -> tuple[Placement, dict[str, Any]]:
    """Bind addresses, URLs and ports for a SLURM job (URLs and the publish token written into cfg, which the
    trainer reads); returns the placement and the gateway's address."""
    placement = plan(cfg, job)
    ports = placement.ports
    cfg.launch.run_api_url = f"http://{placement.connect_host}:{cfg.launch.run_api_port or ports.run_api}"
    gateway_port = cfg.inference.get("port") or ports.gateway
    cfg.launch.gateway_url = f"http://{placement.connect_host}:{gateway_port}"
    if placement.bind_host not in LOOPBACK_HOSTS and not cfg.inference.get("publish_token"):
        # The gateway is reachable from other nodes: only holders of the run's config may publish policies.
        cfg.inference["publish_token"] = "<generated at launch>" if preview else secrets.token_urlsafe(32)
    return placement, {"host": placement.bind_host, "port": gateway_port}


def bind_locally(cfg: RunConfig) -> tuple[dict[str, int], dict[str, Any]]:
    """Outside SLURM: listening sockets for run-api and the gateway, inherited by them. Returns their fds by
    component name and the gateway's address. A run attached to an engine (its gateway set already) binds
    run-api's alone."""
    api = listen("127.0.0.1", cfg.launch.run_api_port)
    if attached(cfg):
        cfg.launch.run_api_url = f"http://127.0.0.1:{api.getsockname()[1]}"
        return {"run-api": api.detach()}, {}
    host = cfg.inference.get("host", "127.0.0.1")
    gateway = listen(host, cfg.inference.get("port", 0))
    connect = "127.0.0.1" if host in ANY_HOST | LOOPBACK_HOSTS else host
    port = gateway.getsockname()[1]
    cfg.launch.run_api_url = f"http://127.0.0.1:{api.getsockname()[1]}"
    cfg.launch.gateway_url = f"http://{connect}:{port}"
    return {"run-api": api.detach(), "gateway": gateway.detach()}, {"host": host, "port": port}


def attached(cfg: RunConfig) -> bool:
    """The run uses a shared engine's gateway and vLLM (inference.engine_url), not its own."""
    return bool(cfg.inference.get("engine_url"))


def redacted(data: Any) -> Any:
    """A copy of a config for printing: secrets shown only as whether they are set (rlcommon/redaction.py)."""
    return redact(data)


def redacted_override(arg: str) -> str:
    """A command-line word for printing: a dotted override of a secret (inference.publish_token=...) hidden."""
    return redact_override(arg)


def write_private(path: Path, text: str) -> None:
    """Config files hold the publish token: readable by the run's user only."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)


def print_dry_run(cfg: RunConfig, run_dir: Path, job: SlurmJob | None) -> int:
    """Everything a launch would start, and its memory plan; exit code 2 when the plan does not fit the GPU."""
    from trainer.orchestration.preflight import describe_model, plan_memory

    resolve_sampler_dtype(cfg)
    placement, address = place_on_slurm(cfg, job, preview=True) if job is not None else (None, None)
    print(yaml.safe_dump(redacted(cfg.model_dump(mode="json")), sort_keys=False), end="")
    tinker = cfg.launch.backend == "tinker"
    wanted = (cfg.tinker.tokenizer or cfg.model.path) if tinker else cfg.model.path
    print(f"# {describe_model(wanted, tokenizer_only=tinker)}")  # a dry run downloads nothing
    if cfg.distill.teacher is not None:
        print(f"# {describe_teacher(cfg)}")
    gateway = None
    if attached(cfg):
        print(
            f"# attached to the engine at {cfg.inference['engine_url']}: its gateway and vLLM, none of the run's own"
        )
    else:
        print("# gateway.yaml (the gateway's own config, validated by it):")
        gateway = redacted(gateway_section(cfg, cfg.model.path, address))
        print(
            "".join(f"#   {line}\n" for line in yaml.safe_dump(gateway, sort_keys=False).splitlines()), end=""
        )
    if job is None or placement is None:
        print("# commands (run-api and the gateway get listening sockets from the launcher):")
    else:
        print(
            f"# placement in SLURM job {job.job_id or '<id>'} on {len(job.hosts)} node(s): {','.join(job.hosts)}"
        )
        for name, hosts in placement.hosts.items():
            print(f"#   {name:<8} on {','.join(hosts)}")
        print(
            f"# ports derived from the job id: run-api {placement.ports.run_api}, gateway "
            f"{placement.ports.gateway}, torchrun rendezvous {placement.ports.rendezvous}"
        )
        print("# commands (srun steps, run concurrently with --overlap):")
    for comp in build_components(cfg, run_dir, cfg.model.path, placement, job.job_id if job else 0):
        if comp.name == "gateway" and gateway is None:
            continue
        env = [f"{k}={shlex.quote(v)}" for k, v in comp.env.items()]  # W&B's identity of the process
        print(f"{comp.name}: {' '.join([*env, *(shlex.quote(a) for a in comp.argv)])}")
    if cfg.rollout.envs:
        print("".join(f"# {line}\n" for line in env_share_lines(cfg)), end="")
    lines, problems = plan_memory(cfg, cfg.model.path, gateway, dry_run=True)
    print("".join(f"# {line}\n" for line in lines), end="", flush=True)
    if problems:
        print(
            "launch.sh: a launch would refuse this config:\n  - " + "\n  - ".join(problems), file=sys.stderr
        )
        return 2
    return 0


def describe_teacher(cfg: RunConfig) -> str:
    """The dry run's line on the distillation teacher (resolved into cfg, so that the memory plan counts it)."""
    from trainer.orchestration.preflight import describe_model

    assert cfg.distill.teacher is not None
    try:
        cfg.distill.teacher = resolve_teacher(cfg.distill.teacher)
    except ConfigError as exc:
        return f"distill.teacher: {exc}"
    if cfg.distill.by_url:  # not asked here: a dry run contacts nothing
        model = cfg.distill.teacher_model or "its only base model"
        token = "with a token" if cfg.distill.api_key() else "without a token"
        return f"distill.teacher: a vLLM server at {cfg.distill.teacher} ({model}, {token}), outside the plan below"
    if teacher_kind(cfg.distill.teacher) == "adapter":
        return f"distill.teacher: a LoRA adapter on the base, scored in the trainer: {cfg.distill.teacher}"
    if cfg.launch.backend == "tinker":
        return f"distill.teacher: scored on Tinker by a sampling client of {cfg.distill.teacher}"
    where = describe_model(cfg.distill.teacher).removeprefix("model: ")
    return f"distill.teacher: a model of its own, scored in the trainer (weights in the plan below): {where}"


def check_memory(cfg: RunConfig, model_path: str) -> None:
    """Print the memory plan; refuse (before anything starts) a CUDA config that cannot fit its GPU, and adapters
    the gateway's rank ceiling would refuse at the first publish."""
    from trainer.orchestration.preflight import plan_memory

    local = cfg.launch.backend == "local" and not attached(cfg)  # an engine's vLLM is planned by the engine
    gateway = gateway_section(cfg, model_path) if local else None
    lines, problems = plan_memory(cfg, model_path, gateway, dry_run=False)
    print("\n".join(lines), flush=True)
    if problems:
        raise ConfigError("the config does not fit its GPU:\n  - " + "\n  - ".join(problems))
    if gateway is not None:
        check_rank_ceiling(cfg, model_path, int(gateway["vllm"]["max_lora_rank"]))


def check_rank_ceiling(cfg: RunConfig, model_path: str, ceiling: int) -> None:
    from trainer.orchestration.model_shape import ModelShape, load_model_config, published_rank

    config = load_model_config(model_path)
    rank = published_rank(ModelShape.from_config(config), cfg) if config is not None else cfg.lora.rank
    if rank > ceiling:
        why = "" if rank == cfg.lora.rank else " (the experts of a MoE model train at twice lora.rank)"
        raise ConfigError(
            f"lora.rank={cfg.lora.rank} publishes adapters of rank {rank}{why}, above the gateway's "
            f"inference.vllm.max_lora_rank={ceiling}, which would refuse the first one: set "
            f"inference.vllm.max_lora_rank={rank} (or more), or a smaller lora.rank"
        )


def resolve_sampler_dtype(cfg: RunConfig) -> None:
    """Write vLLM's dtype for this machine into the run (config.yaml and gateway.yaml alike): the trainer picks its
    verification statistic from it, and the tiny recipes' 'auto' must mean float32 on CPU, bfloat16 on CUDA."""
    if cfg.launch.backend != "local":
        return
    from trainer.orchestration.preflight import probe_gpu_memory

    cuda = cfg.launch.gpu_memory_gib is not None or probe_gpu_memory() is not None
    vllm = dict(cfg.inference.get("vllm") or {})
    cfg.inference = {**cfg.inference, "vllm": {**vllm, "dtype": sampler_dtype(cfg, cuda)}}


def write_run_folder(cfg: RunConfig, run_dir: Path, model_path: str, job: SlurmJob | None) -> list[Component]:
    """Ports, URLs and the two config files; returns the components, not started. A config that cannot run
    (nnodes > 1 outside SLURM) raises before anything is written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run-api").mkdir(exist_ok=True)
    fds: dict[str, int] = {}
    placement = None
    if job is not None:
        placement, address = place_on_slurm(cfg, job)
        print(
            f"SLURM job {job.job_id}: "
            + "; ".join(f"{n} on {','.join(h)}" for n, h in placement.hosts.items()),
            flush=True,
        )
    else:
        fds, address = bind_locally(cfg)
    if cfg.launch.backend == "local":
        cfg.model.path = (
            model_path  # the trainer loads the folder pre-flight resolved (the tiny model included)
        )
    else:
        cfg.tinker.tokenizer = model_path
    components = build_components(cfg, run_dir, model_path, placement, job.job_id if job else 0, fds)
    if attached(cfg):
        components = [c for c in components if c.name != "gateway"]
    else:
        gateway = gateway_section(cfg, model_path, address)
        write_private(run_dir / "gateway.yaml", yaml.safe_dump(gateway, sort_keys=False))
    write_private(run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return components


def trainer_starts_with_vllm(cfg: RunConfig) -> bool:
    """Whether the trainer may load its model while vLLM boots (it waits for the gateway before its first call):
    not when the two may share a GPU, since vLLM sizes its KV cache from the GPU memory it finds free while it
    profiles, and the trainer's weights arriving meanwhile would be taken for vLLM's own."""
    from trainer.orchestration import preflight as checks

    return cfg.launch.backend != "local" or not checks.NVIDIA_CONTROL.exists()


ENV_EXIT_GRACE_S = 1.0  # an environment with a bad flag exits at once: said before the trainer's first step


def start_all(components: list[Component], cfg: RunConfig, run_dir: Path) -> None:
    """run-api and the gateway at once (neither needs the other); the trainer when it may load its model while vLLM
    boots (trainer_starts_with_vllm), and then the environments too: their imports and Atropos's own start-up pause
    (5 s) overlap vLLM's start, and their first requests wait in the gateway until vLLM serves. Where run-api
    inherits its listening socket (outside SLURM), those start with it: their first calls wait in the socket's
    backlog until run-api serves, and its start overlaps their imports; else once it answers. Where the trainer must
    wait (a GPU vLLM shares), everything else waits for the gateway's health (vLLM answered a real completion):
    environments, then the trainer."""
    assert cfg.launch.run_api_url is not None and cfg.launch.gateway_url is not None
    api, trainer = components[0], components[-1]
    gateway = next((c for c in components if c.name == "gateway"), None)  # None: attached to an engine
    envs = [c for c in components[1:-1] if c is not gateway]
    api.start()
    if gateway is not None:
        gateway.start()
    early = trainer_starts_with_vllm(cfg) or gateway is None
    soon, backlog = [trainer, *envs] if early else [], bool(api.pass_fds)
    for comp in soon if backlog else []:
        comp.start()
    what = "answering /status"
    wait_http(
        f"{cfg.launch.run_api_url}/status", api, cfg.launch.health_timeout_s, what, soon if backlog else []
    )
    for comp in [] if backlog else soon:
        comp.start()
    envs_started = time.monotonic()
    if gateway is not None:
        print(
            f"waiting for the gateway and vLLM (log: {gateway.log}, {run_dir / 'logs' / 'vllm.log'})",
            flush=True,
        )
        watched = [trainer, *envs] if early else []
        wait_http(
            f"{cfg.launch.gateway_url}/health", gateway, cfg.launch.health_timeout_s, "healthy", watched
        )
    if not early:
        for env in envs:
            env.start()
        envs_started = time.monotonic()
    time.sleep(max(0.0, ENV_EXIT_GRACE_S - (time.monotonic() - envs_started)))
    for env in envs:
        if env.exited() is not None:
            raise LaunchError(f"{env.name} exited with code {env.exited()}; read {env.log}:\n{env.tail()}")
    if early:
        if trainer.exited() is not None:
            raise LaunchError(
                f"the trainer exited with code {trainer.exited()}; read {trainer.log}:\n{trainer.tail()}"
            )
    else:
        trainer.start()


def launch(
    cfg: RunConfig,
    run_dir: Path,
    dry_run: bool,
    resumed: bool,
    job: SlurmJob | None = None,
    wait: bool = False,
) -> int:
    if cfg.eval.on and cfg.launch.backend == "tinker":
        # Evaluation samples saved adapter folders through the local gateway's vLLM, which a Tinker run has not.
        print(
            "launch.sh: no held-out evaluation with launch.backend=tinker; eval.every_steps set to 0",
            flush=True,
        )
        cfg.eval.every_steps = 0
    if dry_run:
        return print_dry_run(cfg, run_dir, job)
    if not cfg.launch.wandb:  # no process of the run logs to W&B, whatever an environment file asks for
        os.environ["WANDB_MODE"] = "disabled"
    done = read_latest(run_dir) if resumed else None
    if done is not None and done[1].step >= cfg.rollout.num_steps:
        print(
            f"{run_dir} already finished: checkpoint {done[0].name} is step {done[1].step} of "
            f"{cfg.rollout.num_steps}; nothing to start (to train on, resume with rollout.num_steps=N)",
            flush=True,
        )
        return 0
    if attached(cfg) and job is not None:
        raise ConfigError(
            "inference.engine_url: attaching to an engine runs outside SLURM; inside a job the run starts its own"
        )
    model_path = preflight(cfg)
    lease: EngineLease | None = None
    if attached(
        cfg
    ):  # the engine's vLLM dtype comes with it: before the memory plan and the run's config files
        run_dir.mkdir(parents=True, exist_ok=True)
        lease = attach_run(cfg, run_dir, model_path, wait)
        write_attached(run_dir, lease)
        lease.start_renewing()
    try:
        return run_components(cfg, run_dir, model_path, resumed, job, lease)
    finally:
        if lease is not None:
            lease.release()


def run_components(
    cfg: RunConfig,
    run_dir: Path,
    model_path: str,
    resumed: bool,
    job: SlurmJob | None,
    lease: EngineLease | None,
) -> int:
    """Write the run folder, start every component, supervise the run, stop it all and write the report."""
    check_memory(cfg, model_path)
    components = write_run_folder(cfg, run_dir, model_path, job)
    stopping = {"signal": 0}

    def on_signal(signum: int, _: Any) -> None:
        stopping["signal"] = signum
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    print(f"run folder: {run_dir}{' (resumed)' if resumed else ''}", flush=True)
    if cfg.launch.wandb:
        print(
            wandb_group.describe(run_dir, cfg.launch.wandb_project, components[-1].env["WANDB_MODE"]),
            flush=True,
        )
    ended = "failed"
    dashboard = start_dashboard(cfg, run_dir)  # a viewer: stopped with the run, never restarted
    try:
        start_all(components, cfg, run_dir)
        print("all components up; training", flush=True)
        code = Supervisor(components, cfg, run_dir, lease).run()
        ended = "finished"
        return code
    except KeyboardInterrupt:
        print(f"launch.sh: stopping on signal {stopping['signal'] or 'SIGINT'}", file=sys.stderr)
        ended = f"stopped by {signal.Signals(stopping['signal'] or signal.SIGINT).name}"
        return 128 + (stopping["signal"] or signal.SIGINT)
    except LaunchError as exc:
        ended = f"failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        raise
    finally:
        # The trainer first: on a stop it finishes its step, publishes that version (the gateway must still be up
        # to verify and serve it) and writes a final checkpoint; then everything else.
        if components:  # api, gateway (unless attached), *envs, trainer (build_components)
            stop_first(components[-1], TRAINER_STOP_S)
        # The report reads what the trainer and the launcher wrote: with the trainer gone it is written while the
        # other components stop (vLLM takes a second or two), else once everything is stopped.
        report = (
            start_report(run_dir, ended) if not components or components[-1].exited() is not None else None
        )
        stop_all(components + ([dashboard] if dashboard else []))
        # While our handlers stand: a second Ctrl-C cuts the report short, not the launcher.
        finish_report(run_dir, report or start_report(run_dir, ended))
        for s, handler in old.items():
            signal.signal(s, handler)


TRAINER_STOP_S = 20.0  # a stopping trainer's step, publish and checkpoint (the tiny model: about a second)
REPORT_TIMEOUT_S = 20.0  # a 30-step run takes 1.5-3 s, a 100k-step one about 10 s (2-core box)


def start_report(run_dir: Path, ended: str) -> subprocess.Popen[str] | str:
    """Start writing RUN_DIR/report/ (`python -m trainer report RUN_DIR`), rewritten whenever a run ends, stops or
    fails; in a child process with a deadline (finish_report): matplotlib's import stays out of the launcher, and
    neither a slow nor a failing report can hold up or fail the launcher's exit. A process that cannot start is
    the reason, as a string."""
    argv = [PY, "-m", "trainer.readout.report", str(run_dir), "--ended", ended]
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    except OSError as exc:
        return str(exc)


def finish_report(run_dir: Path, report: subprocess.Popen[str] | str) -> None:
    """Wait for the report started by start_report, within REPORT_TIMEOUT_S; whatever happens is one line."""
    by_hand = f"write it with: {PY} -m trainer report {run_dir}"
    if isinstance(report, str):
        print(f"launch.sh: no report ({report}); {by_hand}", flush=True)
        return
    try:
        out, err = report.communicate(timeout=REPORT_TIMEOUT_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        report.kill()
        report.communicate()
        if isinstance(exc, KeyboardInterrupt):
            print(f"launch.sh: report cut short by a signal; {by_hand}", flush=True)
        else:
            print(f"launch.sh: no report: it took over {REPORT_TIMEOUT_S:.0f} s; {by_hand}", flush=True)
        return
    if report.returncode == 0 and out.strip():
        print(f"report: {out.strip().splitlines()[-1]}", flush=True)
        return
    why = (err.strip().splitlines() or [f"exit code {report.returncode}"])[-1]
    print(f"launch.sh: no report ({why}); {by_hand}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("env", nargs="?", help="environment name (toy, gsm8k) or an Atropos env file")
    p.add_argument("--backend", choices=["local", "tinker"], default="local")
    p.add_argument("--config", help="run config YAML (default: configs/<env>.yaml)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the resolved config and commands, start nothing"
    )
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument(
        "--wait",
        action="store_true",
        help="with inference.engine_url: wait while another run holds the engine, instead of refusing",
    )
    p.add_argument(
        "--slurm-nodes",
        metavar="NODELIST",
        help="with --dry-run: show the SLURM placement on these nodes (e.g. 'gpu[01-03]')",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=2e-5")
    args = p.parse_intermixed_args(argv)  # overrides may come before or after the options
    if args.env and "=" in args.env and not Path(args.env).exists():
        # `--resume RUN_DIR key=value` (or `--config FILE key=value`): argparse hands the first override to the
        # optional env positional.
        args.overrides.insert(0, args.env)
        args.env = None
    if not args.env and not args.resume and not args.config:
        p.error(
            "give an environment (e.g. toy), --config FILE (its rollout.env or rollout.envs) or --resume RUN_DIR"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg, run_dir = resolve_run(args)
        if args.slurm_nodes and not args.dry_run:
            raise ConfigError(
                "--slurm-nodes previews a placement and needs --dry-run; under SLURM the job's "
                "own nodes are used"
            )
        job = SlurmJob(0, parse_nodelist(args.slurm_nodes)) if args.slurm_nodes else job_from_env()
        return launch(cfg, run_dir, args.dry_run, resumed=bool(args.resume), job=job, wait=args.wait)
    except ConfigError as exc:
        print(f"launch.sh: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"launch.sh: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
