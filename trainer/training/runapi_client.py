"""The trainer's side of Atropos's run-api: registration, batches (waited for until a stop is requested), and what
a batch holds. SIGTERM ends the loop at a step boundary through a Stopper."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from trainer.training.batch import parse_batch_response
from trainer.training.config import RunConfig
from trainer.training.polling import wait_until
from trainer.training.retries import ComponentDown, RemoteComponent, checked
from trainer.training.wandb_group import wandb_group

log = logging.getLogger("trainer.training.runapi_client")
MAX_REREGISTRATIONS = 5


class RunApi:
    """Atropos's run-api, as the trainer uses it. Calls are retried through transient failures; a run-api that
    answers "not registered" was restarted (by the launcher) and is registered with again at the current step."""

    def __init__(self, cfg: RunConfig, url: str, log: str):
        self.cfg = cfg
        self.edge = RemoteComponent("run-api", url, log, cfg.trainer.retry_budget_s)
        self._http = httpx.Client(base_url=url, timeout=cfg.trainer.request_timeout_s)
        self.step = 0  # where a re-registration starts; the loop keeps it current
        self.reregistrations = 0
        self.unanswered = 0  # re-registrations in a row that run-api did not take
        self._env_names: dict[int, str] = {}
        self._held: list[Any] | None = None  # a batch open_to_environments took, for the next fetch_batch

    def register(self, starting_step: int) -> None:
        self.step = starting_step
        cfg = self.cfg
        body = {
            "wandb_group": wandb_group(Path(cfg.trainer.output_dir)),  # the environments' W&B runs join it
            "wandb_project": cfg.launch.wandb_project,
            "batch_size": cfg.rollout.batch_size,
            # -1: atroposlib drops a whole group when any sequence reaches max_token_len, which a completion cut
            # at the environment's own budget does. The trainer applies its limit per sequence instead
            # (trainer.max_seq_len, trainer.overlong), so nothing the environment scored is lost whole.
            "max_token_len": -1,
            "checkpoint_dir": str(Path(cfg.trainer.output_dir) / "checkpoints"),
            "save_checkpoint_interval": cfg.trainer.checkpoint_every,
            "starting_step": starting_step,
            "num_steps": cfg.runapi_batches(),
        }
        self.edge.call(lambda: checked(self._http.post("/register", json=body)), "/register")

    def open_to_environments(self) -> None:
        """run-api lets environments register only once the trainer has asked for a batch: ask now (after
        `register`), so they get through registration while the trainer still waits for something else. A batch
        that is already there is kept for the loop's first fetch_batch."""
        self._held = self.fetch_batch()

    def fetch_batch(self) -> list[Any] | None:
        if self._held is not None:
            held, self._held = self._held, None
            return held
        body = self.edge.call(lambda: checked(self._http.get("/batch")), "/batch").json()
        if (
            isinstance(body, dict)
            and body.get("status") == "error"
            and "register" in str(body.get("message"))
        ):
            self.unanswered += 1
            if self.unanswered > MAX_REREGISTRATIONS:
                # run-api keeps its first state: one that got data before any registration never takes one.
                raise RuntimeError(
                    f"run-api at {self.edge.url} still answers 'not registered' after {MAX_REREGISTRATIONS} "
                    "registrations; its state is broken (data arrived before the trainer registered). "
                    f"Read {self.edge.log}; a restart of run-api (with the trainer) clears it"
                )
            log.warning(
                "run-api has no registration (it was restarted); registering again at step %d", self.step
            )
            self.reregistrations += 1
            self.register(self.step)
            return None
        self.unanswered = 0
        return parse_batch_response(body)

    def env_names(self, groups: list[Any]) -> dict[int, str]:
        """run-api env id -> environment name for a mixed run (its run-api's GET /envs; the launcher names each
        process `<name>-<worker>`). Asked again only when a batch holds an id not seen yet (a restarted
        environment registers under a new one); an unanswered ask leaves those groups unnamed."""
        ids = {g.get("env_id") for g in groups if isinstance(g, dict)}
        if not ids <= self._env_names.keys():
            try:
                body = checked(self._http.get("/envs")).json()
                self._env_names = {e["env_id"]: str(e["name"]).rsplit("-", 1)[0] for e in body["envs"]}
            except (httpx.HTTPError, ComponentDown, ValueError, KeyError, TypeError) as exc:
                log.warning("run-api did not name its environments (GET /envs): %s", exc)
        return self._env_names

    def queued_by_env(self) -> dict[str, int] | None:
        """A mixed run: the sequences run-api has queued from each connected environment (its workers summed);
        None when run-api does not answer."""
        try:
            envs = checked(self._http.get("/envs")).json()["envs"]
            out: dict[str, int] = {}
            for e in envs:
                if e["connected"]:
                    name = str(e["name"]).rsplit("-", 1)[0]
                    out[name] = out.get(name, 0) + int(e["queued_sequences"])
            return out
        except (httpx.HTTPError, ComponentDown, ValueError, KeyError, TypeError) as exc:
            log.warning("run-api did not report its environments' queues (GET /envs): %s", exc)
            return None

    def shortfalls(self) -> dict[str, float]:
        """A mixed run's `rollouts/<env>/short_batches` and `.../shortfall_sequences`: batches run-api formed
        without an environment's full share after rollout.mix_wait_s (trainer/orchestration/run_api.py), and the
        sequences it fell short by, counted since run-api started. Empty when run-api does not answer."""
        out: dict[str, float] = {}
        try:
            envs = checked(self._http.get("/envs")).json()["envs"]
            for e in envs:
                name = str(e["name"]).rsplit("-", 1)[0]
                for key in ("short_batches", "shortfall_sequences"):
                    out[f"rollouts/{name}/{key}"] = out.get(f"rollouts/{name}/{key}", 0.0) + float(e[key])
        except (httpx.HTTPError, ComponentDown, ValueError, KeyError, TypeError) as exc:
            log.warning("run-api did not report its environments' shortfall (GET /envs): %s", exc)
        return out


class StopRequested(Exception):
    """SIGTERM arrived while the trainer was between steps."""


class Stopper:
    """SIGTERM (the launcher stopping the run) ends the loop at the next step boundary, where the state on disk
    and in memory agree, so the final checkpoint is exact; a step under way is finished first."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, _: Any) -> None:
        log.warning("signal %d: stopping after the current step with a final checkpoint", signum)
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise StopRequested


def wait_for_batch(
    api: RunApi,
    poll_s: float,
    stopper: Stopper | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> list[Any]:
    """The next batch, however long the environments take to fill it (or until a stop is requested); `meanwhile`
    runs before each poll."""

    def ready() -> list[Any] | None:
        if stopper is not None:
            stopper.check()
        if meanwhile is not None:
            meanwhile()
        return api.fetch_batch()

    return wait_until(ready, None, "a batch from run-api", poll_s)


def sampled_tokens(groups: list[Any]) -> int:
    return sum(sum(1 for m in row if m != -100) for g in groups for row in g.get("masks", []))
