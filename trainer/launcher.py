"""The process supervisor behind launch.sh: resolve and validate the run config, write the run folder, start
run-api, the gateway (with vLLM), the environment(s) and the trainer in that order, each after the previous one is
healthy, print one line per training step, and stop everything it started (its own children, by PID/process
group) on Ctrl-C, SIGTERM, a component's death, or the end of the run.

    python -m trainer.launcher ENV [--backend local|tinker] [--config FILE] [--dry-run] [--resume RUN_DIR] [k=v ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from inference.config import LOOPBACK_HOSTS
from inference.vllm_backend import die_with_parent, free_port
from trainer.config import ConfigError, RunConfig, load_config
from trainer.slurm import Placement, SlurmJob, job_from_env, parse_nodelist, plan, srun_prefix

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


class LaunchError(RuntimeError):
    """A component could not start or died; the message names the log to read."""


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    slurm_job: int | None = None  # set when argv is an srun step of this job
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as logf:
            logf.write(f"=== {' '.join(shlex.quote(a) for a in self.argv)}\n".encode())
            logf.flush()
            # Own process group: stopping the component also stops whatever it started.
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, stdout=logf, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env}, start_new_session=True,
                                         preexec_fn=die_with_parent)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        """Ask the component to shut down cleanly (SIGTERM to it, not to its children)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        step = self._slurm_step()
        if step is not None:
            # A signal to srun makes SLURM SIGKILL the task, which then cannot stop what it started (the gateway
            # its vLLM); scancel delivers SIGTERM to the task itself and srun exits when the task does.
            subprocess.run(["scancel", "--signal=TERM", step], capture_output=True, timeout=30)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def _slurm_step(self) -> str | None:
        """`<job>.<step>` of this component's srun step, found by its step name."""
        if self.slurm_job is None:
            return None
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["squeue", "-h", "-s", "-j", str(self.slurm_job), "-o", "%i %j"],
                                 capture_output=True, text=True, timeout=30).stdout
            for line in out.splitlines():
                step, _, name = line.strip().partition(" ")
                if name.strip() == self.name:
                    return step
        return None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def resolve_env_module(env: str) -> list[str]:
    """`python -m environments.<name>` for a built-in name, `python <file>` for any Atropos env file."""
    if env.endswith(".py"):
        path = Path(env)
        if not path.is_file():
            raise ConfigError(f"rollout.env={env!r}: no such environment file")
        return [PY, str(path.resolve())]
    if not (ROOT / "environments" / f"{env}.py").is_file():
        names = sorted(p.stem for p in (ROOT / "environments").glob("*.py") if not p.stem.startswith("_"))
        raise ConfigError(f"unknown environment {env!r}: built-in ones are {names}, or pass a path to an env file")
    return [PY, "-m", f"environments.{env}"]


def env_command(cfg: RunConfig, model_path: str, worker: int) -> list[str]:
    r = cfg.rollout
    # Atropos caps queued + in-flight rollouts at this many batches, which bounds their lag in versions.
    offpolicy = r.max_batches_offpolicy or max(1, r.max_staleness)
    flags: dict[str, Any] = {
        "env.rollout_server_url": cfg.launch.run_api_url,
        "env.group_size": r.group_size,
        "env.batch_size": r.batch_size,
        "env.max_batches_offpolicy": offpolicy,
        "env.total_steps": -1,  # follow run-api's num_steps (the trainer's registration)
        "env.max_token_length": r.max_token_length,
        "env.tokenizer_name": model_path,
        "env.use_wandb": False,
        "env.seed": r.seed + worker,
        "env.wandb_name": f"{Path(r.env).stem}-{worker}",
        "env.temperature": r.temperature,
        "env.max_new_tokens": r.max_new_tokens,
        "openai.base_url": f"{cfg.launch.gateway_url}/v1",
        "openai.api_key": "local",
        "openai.model_name": model_path,
        "openai.tokenizer_name": model_path,
        "openai.server_type": "vllm",
        **{f"env.{k}": v for k, v in r.env_args.items()},
    }
    if r.env.endswith(".py"):  # any Atropos env: only BaseEnvConfig's own fields can be assumed
        flags.pop("env.temperature")
        flags.pop("env.max_new_tokens")
    argv = [*resolve_env_module(r.env), "serve"]
    for key, value in flags.items():
        # key=value in one token: atroposlib reads `--flag -1` as a bare boolean flag
        argv.append(f"--{key}={json.dumps(value) if isinstance(value, list | dict) else value}")
    return argv


def build_components(cfg: RunConfig, run_dir: Path, model_path: str, placement: Placement | None = None,
                     job_id: int = 0) -> list[Component]:
    """The run's processes in start order. With a SLURM placement each one is an srun step on its node(s)."""
    logs = run_dir / "logs"
    config_file = str(run_dir / "config.yaml")
    api_port = cfg.launch.run_api_url.rsplit(":", 1)[1] if cfg.launch.run_api_url else "<port>"
    gw_port = cfg.launch.gateway_url.rsplit(":", 1)[1] if cfg.launch.gateway_url else "<port>"
    bind = placement.bind_host if placement else "127.0.0.1"
    argvs: dict[str, list[str]] = {
        "run-api": [PY, "-m", "atroposlib.cli.run_api", "--host", bind, "--port", api_port],
        "gateway": [PY, "-m", "inference", "--config", config_file, "--log-dir", str(logs),
                    f"inference.port={gw_port}"],
    }
    for w in range(cfg.rollout.env_workers):
        argvs["env" if cfg.rollout.env_workers == 1 else f"env-{w}"] = env_command(cfg, model_path, w)
    rendezvous = f"{placement.hosts['trainer'][0]}:{placement.ports.rendezvous}" if placement else None
    argvs["trainer"] = trainer_command(cfg, config_file, rendezvous, str(job_id))
    if cfg.distributed.devices:
        # Inside the command, not srun's environment: slurmstepd rewrites CUDA_VISIBLE_DEVICES for GPU steps.
        argvs["trainer"] = ["env", f"CUDA_VISIBLE_DEVICES={cfg.distributed.devices}", *argvs["trainer"]]
    components = []
    for name, argv in argvs.items():
        if placement is not None:
            argv = [*srun_prefix(name, placement.hosts[name], job_id), *argv]
        # run-api gets an empty cwd: it must not watch our files.
        components.append(Component(name, argv, logs / f"{name}.log", cwd=run_dir / "run-api" if name == "run-api"
                                    else ROOT, slurm_job=job_id if placement is not None else None))
    return components


def trainer_command(cfg: RunConfig, config_file: str, rendezvous: str | None = None, run_id: str = "rl") -> list[str]:
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
        raise ConfigError(f"distributed.nnodes={d.nnodes}: a trainer across nodes needs SLURM (sbatch launch.sh)")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}", f"--rdzv-id={run_id}"]
    return argv + run


def wait_http(url: str, comp: Component, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = comp.exited()
        if code is not None:
            raise LaunchError(f"{comp.name} exited with code {code} before {what}; read {comp.log}:\n{comp.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise LaunchError(f"{comp.name} not {what} within {timeout_s:.0f}s; read {comp.log}:\n{comp.tail()}")
        time.sleep(0.5)


def stop_all(components: list[Component], timeout_s: float = 30.0) -> None:
    live = [c for c in components if c.proc is not None and c.proc.poll() is None]
    for comp in reversed(live):
        comp.terminate()
    deadline = time.monotonic() + timeout_s
    for comp in live:
        assert comp.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            comp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for comp in live:
        if comp.slurm_job is not None and comp.proc is not None and comp.proc.poll() is None:
            # SIGTERM to srun: SLURM kills the step's tasks on every node (SIGKILL to srun alone would not).
            comp.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                comp.proc.wait(timeout=10)
    for comp in components:  # anything left in a component's group (including its children) is killed
        if comp.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(comp.proc.pid, signal.SIGKILL)
            comp.proc.wait()


def progress_line(row: dict[str, Any], total: int) -> str:
    def fmt(key: str, spec: str) -> str:
        return "-" if row.get(key) is None else format(row[key], spec)

    return (f"step {row['step']:>4}/{total} | v{row['policy_version']} | reward {fmt('reward/mean', '.3f')} | "
            f"loss {fmt('loss', '+.4f')} | "
            f"step {row['time/step_s']:.2f}s (wait {row['time/wait_for_batch_s']:.2f}s, train "
            f"{row['time/train_s']:.2f}s, publish {row['time/publish_s']:.2f}s) | staleness "
            f"{row['policy/staleness_mean']:.2f}/{row['policy/staleness_max']:.0f} | dropped stale "
            f"{row['rollouts/dropped_stale']:.0f}")


ENVS_DONE_GRACE_S = 600.0  # the trainer may still be finishing its last step after the envs hit num_steps


def supervise(components: list[Component], cfg: RunConfig, metrics: Path) -> int:
    trainer = components[-1]
    envs = [c for c in components if c.name.startswith("env")]
    seen = 0
    envs_done_at: float | None = None
    while True:
        if metrics.exists():
            rows = metrics.read_text().splitlines()
            for line in rows[seen:]:
                print(progress_line(json.loads(line), cfg.rollout.num_steps), flush=True)
            seen = len(rows)
        code = trainer.exited()
        if code is not None:
            if code == 0:
                print(f"run finished: {metrics}\ncompare runs: {Path(PY).parent}/python -m trainer.report "
                      f"{metrics.parent} OTHER_RUN_DIR ... --out REPORT_DIR", flush=True)
                return 0
            raise LaunchError(f"trainer exited with code {code}; read {trainer.log}:\n{trainer.tail()}")
        for comp in components[:-1]:
            code = comp.exited()
            if code is not None and not (comp in envs and code == 0):
                raise LaunchError(f"{comp.name} exited with code {code}; read {comp.log}:\n{comp.tail()}")
        if envs_done_at is None and all(e.exited() == 0 for e in envs):
            envs_done_at = time.monotonic()  # an env stops by itself once run-api's step count is reached
        if envs_done_at is not None and time.monotonic() - envs_done_at > ENVS_DONE_GRACE_S:
            raise LaunchError(f"every environment finished but the trainer is still waiting; read {trainer.log}")
        time.sleep(0.5)


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    if args.resume:
        run_dir = Path(args.resume).resolve()
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {args.resume}: no config.yaml there; pass a run folder launch.sh made")
        cfg = load_config(RunConfig, run_dir / "config.yaml", args.overrides)
        return cfg, run_dir
    config = Path(args.config) if args.config else ROOT / "configs" / f"{Path(args.env).stem}.yaml"
    if not config.is_file():
        raise ConfigError(f"no config {config}; pass --config FILE (e.g. configs/tiny_cpu.yaml)")
    # --backend goes through validation with the rest (RunConfig refuses e.g. Tinker with data-parallel ranks).
    overrides = [f"rollout.env={args.env}", *args.overrides, f"launch.backend={args.backend}"]
    if not any(o.startswith("trainer.output_dir=") for o in args.overrides):
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        overrides.append(f"trainer.output_dir={ROOT / 'runs' / f'{Path(args.env).stem}-{stamp}'}")
    cfg = load_config(RunConfig, config, overrides)
    run_dir = Path(cfg.trainer.output_dir).resolve()
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or choose a new folder")
    cfg.trainer.output_dir = str(run_dir)
    return cfg, run_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("env", nargs="?", help="environment name (toy, gsm8k) or an Atropos env file")
    p.add_argument("--backend", choices=["local", "tinker"], default="local")
    p.add_argument("--config", help="run config YAML (default: configs/<env>.yaml)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and commands, start nothing")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--slurm-nodes", metavar="NODELIST",
                   help="with --dry-run: show the SLURM placement on these nodes (e.g. 'gpu[01-03]')")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=2e-5")
    args = p.parse_intermixed_args(argv)  # overrides may come before or after the options
    if args.env and "=" in args.env and not Path(args.env).exists():
        # `--resume RUN_DIR key=value`: argparse hands the first override to the optional env positional.
        args.overrides.insert(0, args.env)
        args.env = None
    if not args.env and not args.resume:
        p.error("give an environment (e.g. toy) or --resume RUN_DIR")
    try:
        cfg, run_dir = resolve_run(args)
        if args.slurm_nodes and not args.dry_run:
            raise ConfigError("--slurm-nodes previews a placement and needs --dry-run; under SLURM the job's "
                              "own nodes are used")
        job = SlurmJob(0, parse_nodelist(args.slurm_nodes)) if args.slurm_nodes else job_from_env()
        return launch(cfg, run_dir, args.dry_run, resumed=bool(args.resume), job=job)
    except ConfigError as exc:
        print(f"launch.sh: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"launch.sh: {exc}", file=sys.stderr)
        return 1


def place_on_slurm(cfg: RunConfig, job: SlurmJob, preview: bool = False) -> Placement:
    """Bind addresses, URLs and ports for a SLURM job (written into cfg, which every component reads)."""
    placement = plan(cfg, job)
    ports = placement.ports
    cfg.launch.run_api_url = f"http://{placement.connect_host}:{cfg.launch.run_api_port or ports.run_api}"
    cfg.launch.gateway_url = f"http://{placement.connect_host}:{cfg.inference.port or ports.gateway}"
    cfg.inference.host = placement.bind_host
    if placement.bind_host not in LOOPBACK_HOSTS and not cfg.inference.publish_token:
        # The gateway is reachable from other nodes: only holders of the run's config may publish policies.
        cfg.inference.publish_token = "<generated at launch>" if preview else secrets.token_urlsafe(24)
    return placement


def print_dry_run(cfg: RunConfig, run_dir: Path, job: SlurmJob | None) -> None:
    placement = place_on_slurm(cfg, job, preview=True) if job is not None else None
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    if job is None or placement is None:
        print("# commands (ports are chosen at launch when 0):")
    else:
        print(f"# placement in SLURM job {job.job_id or '<id>'} on {len(job.hosts)} node(s): {','.join(job.hosts)}")
        for name, hosts in placement.hosts.items():
            print(f"#   {name:<8} on {','.join(hosts)}")
        print(f"# ports derived from the job id: run-api {placement.ports.run_api}, gateway "
              f"{placement.ports.gateway}, torchrun rendezvous {placement.ports.rendezvous}")
        print("# commands (srun steps, run concurrently with --overlap):")
    for comp in build_components(cfg, run_dir, cfg.model.path, placement, job.job_id if job else 0):
        print(f"{comp.name}: {' '.join(shlex.quote(a) for a in comp.argv)}")


def launch(cfg: RunConfig, run_dir: Path, dry_run: bool, resumed: bool, job: SlurmJob | None = None) -> int:
    from trainer.preflight import check_environment, check_model

    if dry_run:
        print_dry_run(cfg, run_dir, job)
        return 0
    problems, model_path = [], cfg.model.path
    try:
        if cfg.launch.backend == "tinker":
            # Tinker holds the weights; this box needs only the tokenizer (envs, gateway) and a valid key.
            model_path = check_model(cfg.tinker.tokenizer or cfg.model.path)
            cfg.tinker.tokenizer = model_path
            if not cfg.tinker.client_factory:
                from trainer.tinker_backend import check_api_key, import_tinker

                import_tinker()
                check_api_key()
        else:
            model_path = check_model(cfg.model.path)
    except ConfigError as exc:
        problems.append(str(exc))
    try:
        check_environment(cfg)
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:  # report everything that is missing at once, not one thing per attempt
        raise ConfigError("cannot start:\n  - " + "\n  - ".join(problems))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run-api").mkdir(exist_ok=True)
    placement = None
    if job is not None:
        placement = place_on_slurm(cfg, job)
        print(f"SLURM job {job.job_id}: " + "; ".join(f"{n} on {','.join(h)}" for n, h in placement.hosts.items()),
              flush=True)
    else:
        # Fresh ports on every launch (a resumed run included) unless the config pins them.
        cfg.launch.run_api_url = f"http://127.0.0.1:{cfg.launch.run_api_port or free_port()}"
        cfg.launch.gateway_url = f"http://127.0.0.1:{cfg.inference.port or free_port()}"
    # Built before config.yaml is written: a config that cannot run (nnodes > 1 outside SLURM) leaves no trace.
    components = build_components(cfg, run_dir, model_path, placement, job.job_id if job else 0)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    stopping = {"signal": 0}

    def on_signal(signum: int, _: Any) -> None:
        stopping["signal"] = signum
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    print(f"run folder: {run_dir}{' (resumed)' if resumed else ''}", flush=True)
    try:
        api, gateway, *envs, trainer = components
        api.start()
        wait_http(f"{cfg.launch.run_api_url}/status", api, cfg.launch.health_timeout_s, "answering /status")
        gateway.start()
        print(f"waiting for the gateway and vLLM (log: {gateway.log}, {run_dir / 'logs' / 'vllm.log'})", flush=True)
        wait_http(f"{cfg.launch.gateway_url}/health", gateway, cfg.launch.health_timeout_s, "healthy")
        # vLLM runs in its own process group under the gateway; record it so a user (or test) can check on it.
        sampler_pid = httpx.get(f"{cfg.launch.gateway_url}/policy", timeout=10).json().get("backend_pid")
        for env in envs:
            env.start()
        time.sleep(1.0)
        for env in envs:
            if env.exited() is not None:
                raise LaunchError(f"{env.name} exited with code {env.exited()}; read {env.log}:\n{env.tail()}")
        trainer.start()
        pids = {c.name: c.proc.pid for c in components if c.proc}
        (run_dir / "pids.json").write_text(json.dumps({**pids, "vllm": sampler_pid}))
        print("all components up; training", flush=True)
        return supervise(components, cfg, run_dir / "metrics.jsonl")
    except KeyboardInterrupt:
        print(f"launch.sh: stopping on signal {stopping['signal'] or 'SIGINT'}", file=sys.stderr)
        return 128 + (stopping["signal"] or signal.SIGINT)
    finally:
        stop_all(components)
        for s, handler in old.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
