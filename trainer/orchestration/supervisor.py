"""Watching a running run, and healing it: print each new metrics row; when a component dies, restart it (and what
depends on it) within a budget of restarts per hour; count every restart where the trainer's next metrics row
picks it up (RUN_DIR/faults.json). Who restarts what:

- vLLM: the gateway (inference/samplers/vllm.py); the supervisor only counts its restarts.
- an environment: restarted alone; it registers with run-api again and resumes its data position.
- run-api: restarted on the same socket, then the environments (their registrations died with it); the trainer
  registers again by itself. Rollouts queued in run-api are lost and counted (`lost_queued_sequences`).
- the trainer: run-api and the environments are restarted with it, so that run-api's step count starts again from
  the trainer's last checkpoint, which the new trainer resumes from.
- the gateway: restarted on the same socket; the trainer publishes its current version to it again.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from trainer.orchestration.attach import EngineLease, lease_headers
from trainer.orchestration.commands import PY
from trainer.orchestration.evaluation import Evaluator
from trainer.orchestration.idle import Snapshot, explain_idle, log_tail
from trainer.orchestration.processes import Component, drain_backlog, stop_all
from trainer.training.checkpoints import VERSION_DIR, write_atomic
from trainer.training.config import RunConfig
from trainer.training.faults import EXIT_NEEDS_OPERATOR, FAULT_KEYS, FAULTS_FILE, PER_ENV_RESTARTS
from trainer.training.polling import wait_until

ENVS_DONE_GRACE_S = 600.0  # the trainer may still be finishing its last step after the envs hit num_steps
PROBE_EVERY_S = 5.0  # run-api's queue and the gateway's vLLM restart count
HOUR_S = 3600.0


class LaunchError(RuntimeError):
    """A component could not start or died past its restart budget; the message names the log to read."""


def wait_http(
    url: str, comp: Component, timeout_s: float, what: str, watched: Sequence[Component] = ()
) -> None:
    """Wait for `url` to answer 200; the exit of `comp`, or of a `watched` component meanwhile, is a LaunchError."""

    def answered() -> bool:
        for one in (comp, *watched):
            code = one.exited()
            if code is not None:
                when = what if one is comp else f"the {comp.name} was {what}"
                raise LaunchError(
                    f"{one.name} exited with code {code} before {when}; read {one.log}:\n{one.tail()}"
                )
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url, timeout=5).status_code == 200
        return False

    try:
        wait_until(answered, timeout_s, f"{comp.name} {what}")
    except TimeoutError:
        raise LaunchError(
            f"{comp.name} not {what} within {timeout_s:.0f}s; read {comp.log}:\n{comp.tail()}"
        ) from None


def progress_line(row: dict[str, Any], total: int) -> str:
    def fmt(key: str, spec: str) -> str:
        return "-" if row.get(key) is None else format(row[key], spec)

    return (
        f"step {row['step']:>4}/{total} | v{row['policy_version']} | reward {fmt('reward/mean', '.3f')} | "
        f"loss {fmt('loss', '+.4f')} | "
        f"step {row['time/step_s']:.2f}s (wait {row['time/wait_for_batch_s']:.2f}s, train "
        f"{row['time/train_s']:.2f}s, publish {fmt('time/publish_s', '.2f')}s) | staleness "
        f"{row['policy/staleness_mean']:.2f}/{row['policy/staleness_max']:.0f} | dropped stale "
        f"{row['rollouts/dropped_stale']:.0f}"
    )


class Supervisor:
    """Runs until the trainer finishes (returns 0) or something cannot be healed (raises LaunchError). An
    environment may exit 0: it stops by itself once run-api's step count is reached."""

    def __init__(
        self, components: list[Component], cfg: RunConfig, run_dir: Path, lease: EngineLease | None = None
    ):
        self.components = components
        self.api, self.trainer = components[0], components[-1]
        # None on a shared engine (launch.sh engine): its own supervisor restarts its gateway.
        self.gateway = next((c for c in components if c.name == "gateway"), None)
        self.envs = [c for c in components[1:-1] if c is not self.gateway]
        self.lease = lease
        self.cfg = cfg
        self.run_dir = run_dir
        self.metrics = run_dir / "metrics.jsonl"
        self.rows_seen = 0
        self.envs_done_at: float | None = None
        self.restarted_at: dict[str, list[float]] = {}
        self.faults: dict[str, int] = dict.fromkeys(FAULT_KEYS, 0)
        self.queued = 0  # sequences waiting in run-api at the last probe
        # The gateway's count at the last probe; on an engine, unknown until the first (earlier runs' restarts).
        self.vllm_restarts = 0 if self.gateway is not None else -1
        self.next_probe = 0.0
        self.progress_at = time.monotonic()  # the last new metrics row (or the start)
        self.progress_seen = Snapshot()  # the components' counts then
        self.latest = Snapshot()  # their counts at the last probe
        self.next_idle_warning = 0.0
        token = cfg.inference.get("publish_token")
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.auth.update(lease_headers(cfg))
        self.evaluator = Evaluator(cfg, run_dir, cfg.launch.gateway_url or "", self.auth)
        self.last_row: dict[str, Any] | None = None

    def run(self) -> int:
        self.write_pids()
        self.evaluator.start()
        try:
            while (code := self.poll()) is None:
                time.sleep(0.5)
            return code
        finally:
            self.evaluator.stop()  # an evaluation still running when the run stops or fails

    def poll(self) -> int | None:
        self.print_new_rows()
        self.evaluator.poll()
        code = self.trainer.exited()
        if code == 0:
            self.evaluator.finish(self.last_row)
            print(
                f"run finished: {self.metrics}\ncompare runs: {Path(PY).parent}/python -m trainer report "
                f"{self.run_dir} OTHER_RUN_DIR ... --out REPORT_DIR",
                flush=True,
            )
            return 0
        if code is not None:
            self.heal(self.trainer, code)
            return None
        if self.lease is not None and self.lease.lost:
            raise LaunchError(self.lease.lost)
        for comp in (self.api, *self.envs) if self.gateway is None else (self.api, self.gateway, *self.envs):
            code = comp.exited()
            if code is not None and not (comp in self.envs and code == 0):
                self.heal(comp, code)
                return None
        if self.envs_done_at is None and all(e.exited() == 0 for e in self.envs):
            self.envs_done_at = time.monotonic()
        if self.envs_done_at is not None and time.monotonic() - self.envs_done_at > ENVS_DONE_GRACE_S:
            raise LaunchError(
                f"every environment finished but the trainer is still waiting; read {self.trainer.log}"
            )
        if time.monotonic() >= self.next_probe:
            self.probe()
        self.warn_if_idle()
        return None

    # --- healing --------------------------------------------------------------------------------------------

    def heal(self, comp: Component, code: int) -> None:
        self.allow_restart(comp, code)
        if comp is self.trainer:
            group, key = [self.api, *self.envs, self.trainer], "restarts_trainer"
            self.faults["lost_queued_sequences"] += self.queued
        elif comp is self.api:
            group, key = [self.api, *self.envs], "restarts_run_api"
            self.faults["lost_queued_sequences"] += self.queued
        elif comp is self.gateway:
            group, key = [self.gateway], "restarts_gateway"
        else:
            group, key = [comp], "restarts_env"
            per_env = PER_ENV_RESTARTS + comp.name  # which environment, beside the total
            self.faults[per_env] = self.faults.get(per_env, 0) + 1
        also = [c.name for c in group if c is not comp]
        print(
            f"launch.sh: {comp.name} died (exit code {code}); restarting it"
            + (f" with {', '.join(also)}" if also else "")
            + f" (restart {len(self.restarted_at[comp.name])} this hour; log {comp.log})",
            flush=True,
        )
        self.faults[key] += 1
        self.queued = 0
        self.restart(group)
        self.write_faults()
        self.write_pids()
        self.envs_done_at = None

    def allow_restart(self, comp: Component, code: int) -> None:
        if comp is self.trainer and code == EXIT_NEEDS_OPERATOR:
            raise LaunchError(f"trainer stopped and needs you; read {comp.log}:\n{comp.tail()}")
        now = time.monotonic()
        recent = [t for t in self.restarted_at.get(comp.name, []) if now - t < HOUR_S]
        limit = self.cfg.launch.max_restarts_per_hour
        if len(recent) >= limit:
            why = (
                "restarts are off" if limit == 0 else f"it was restarted {len(recent)} times within the hour"
            )
            raise LaunchError(
                f"{comp.name} exited with code {code} and {why} (launch.max_restarts_per_hour={limit}); "
                f"read {comp.log}:\n{comp.tail()}"
            )
        self.restarted_at[comp.name] = [*recent, now]

    def restart(self, group: list[Component]) -> None:
        """Stop what is still running in `group`, then start it again in start order, each once the one before is
        healthy; a run-api that inherits its listening socket is waited for after the rest has started, as at the
        launch (start_all): what calls it meanwhile waits in the socket's backlog."""
        stop_all(group)
        timeout = self.cfg.launch.health_timeout_s
        api_url = f"{self.cfg.launch.run_api_url}/status"
        for comp in self.components:
            if comp not in group:
                continue
            if comp is self.api:
                for fd in comp.pass_fds:
                    if closed := drain_backlog(fd):
                        print(f"launch.sh: dropped {closed} connections made to the dead run-api", flush=True)
            comp.start()
            if comp is self.api and not comp.pass_fds:
                wait_http(api_url, comp, timeout, "answering /status")
            elif comp is self.gateway:
                wait_http(f"{self.cfg.launch.gateway_url}/health", comp, timeout, "healthy")
                self.vllm_restarts = 0  # a new gateway counts its vLLM restarts from zero
                self.republish_newest()
        if self.api in group and self.api.pass_fds:
            wait_http(api_url, self.api, timeout, "answering /status")  # the others' exits: healed by poll

    def republish_newest(self) -> None:
        """A restarted gateway serves the base model until told otherwise: hand it the newest adapter at once, so
        the environments do not sample (and the trainer then drop) a batch from the base model. The trainer's own
        check at its next step corrects this if the newest folder was not yet published; its retried publish of
        that folder is then a no-op."""
        versions = [
            (int(m.group(1)), p)
            for p in (self.run_dir / "adapters").glob("v*")
            if (m := VERSION_DIR.match(p.name)) and p.is_dir()
        ]
        if not versions:
            return
        version, path = max(versions)
        body = {"version": version, "adapter_path": str(path), "replace_newer": True}
        with contextlib.suppress(httpx.HTTPError):
            url = f"{self.cfg.launch.gateway_url}/policy/publish"
            reply = httpx.post(url, json=body, headers=self.auth, timeout=120)
            print(
                f"launch.sh: gave the restarted gateway version {version} ({reply.status_code})", flush=True
            )

    # --- observing ------------------------------------------------------------------------------------------

    def probe(self) -> None:
        """Remember run-api's queue (lost if it dies), count vLLM restarts the gateway made, and keep both answers
        for the idle-run line."""
        self.next_probe = time.monotonic() + PROBE_EVERY_S
        status = policy = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            status = httpx.get(f"{self.cfg.launch.run_api_url}/status", timeout=5).json()
            self.queued = int(status["queue_size"])
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            url = f"{self.cfg.launch.gateway_url}/policy"
            policy = httpx.get(url, timeout=5, headers=self.auth).json()
            restarts = int(policy["restarts"])
            if 0 <= self.vllm_restarts < restarts:
                self.faults["restarts_vllm"] += restarts - self.vllm_restarts
                print(
                    f"launch.sh: the gateway restarted vLLM (restart {restarts}; log "
                    f"{self.run_dir / 'logs' / 'vllm.log' if self.gateway else 'the engine folder vllm.log'})",
                    flush=True,
                )
                self.write_faults()
                self.write_pids()
            self.vllm_restarts = restarts
        self.latest = Snapshot.read(policy, status)

    def write_faults(self) -> None:
        write_atomic(self.run_dir / FAULTS_FILE, json.dumps(self.faults))

    def write_pids(self) -> None:
        """RUN_DIR/pids.json: each component's PID and vLLM's, for a person (or a fault test) to look at. On a
        shared engine vLLM is the engine's, not the run's: `engine_vllm`, which outlives the run."""
        pids: dict[str, int | None] = {c.name: c.proc.pid for c in self.components if c.proc}
        key = "vllm" if self.gateway is not None else "engine_vllm"
        pids[key] = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            url = f"{self.cfg.launch.gateway_url}/policy"
            pids[key] = httpx.get(url, timeout=5, headers=self.auth).json().get("backend_pid")
        write_atomic(self.run_dir / "pids.json", json.dumps(pids))

    def print_new_rows(self) -> None:
        if not self.metrics.exists():
            return
        text = self.metrics.read_text()
        rows = text.splitlines()[: text.count("\n")]  # a row being written is read at the next poll
        if len(rows) < self.rows_seen:  # a restarted trainer dropped the rows after its checkpoint
            self.rows_seen = len(rows)
        for line in rows[self.rows_seen :]:
            with contextlib.suppress(ValueError, KeyError):
                row = json.loads(line)
                print(progress_line(row, self.cfg.rollout.num_steps), flush=True)
                self.last_row = row
                self.evaluator.on_row(row)
        if len(rows) > self.rows_seen:
            self.progress_at = time.monotonic()
            self.progress_seen = self.latest  # the last probe's counts: at most PROBE_EVERY_S old
        self.rows_seen = len(rows)

    def warn_if_idle(self) -> None:
        """Every launch.idle_warn_s without a step: one line naming the likeliest cause."""
        limit, now = self.cfg.launch.idle_warn_s, time.monotonic()
        if not limit or now - self.progress_at < limit or now < self.next_idle_warning:
            return
        self.next_idle_warning = now + limit
        env_log = self.envs[0].log if self.envs else self.trainer.log
        tail = "".join(log_tail(e.log) for e in self.envs)
        print(
            explain_idle(
                now - self.progress_at,
                self.progress_seen,
                self.latest,
                self.cfg.rollout.batch_size,
                tail,
                str(env_log),
            ),
            flush=True,
        )
