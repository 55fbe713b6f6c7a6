"""The launcher's start order: run-api and the gateway at once; the trainer loads its model and the environments
start while vLLM boots, unless the trainer and vLLM may share a GPU: then the environments once the gateway is
healthy, and the trainer last. Where run-api inherits its listening socket, the trainer and the environments start
with it (their calls wait in the backlog); else once it answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from trainer.orchestration import launcher, supervisor
from trainer.training.config import RunConfig, load_config


class FakeComponent:
    def __init__(
        self, name: str, events: list[str], exit_code: int | None = None, pass_fds: tuple[int, ...] = ()
    ):
        self.name, self.events, self.code, self.pass_fds = name, events, exit_code, pass_fds
        self.log = Path(f"{name}.log")

    def start(self) -> None:
        self.events.append(f"start {self.name}")

    def exited(self) -> int | None:
        return self.code

    def tail(self) -> str:
        return "(log tail)"


NAMES = ("run-api", "gateway", "env", "trainer")


def endpoints() -> RunConfig:
    return load_config(
        RunConfig, None, ["launch.run_api_url=http://127.0.0.1:1", "launch.gateway_url=http://127.0.0.1:2"]
    )


def components(events: list[str], exits: dict[str, int | None], api_socket: bool) -> list[FakeComponent]:
    """run-api, the gateway, an environment and the trainer; run-api with an inherited socket if `api_socket`."""
    return [
        FakeComponent(n, events, exits.get(n), (3,) if api_socket and n == "run-api" else ()) for n in NAMES
    ]


def started(
    monkeypatch,
    early: bool,
    trainer_exit: int | None = None,
    env_exit: int | None = None,
    api_socket: bool = False,
) -> list[str]:
    events: list[str] = []
    monkeypatch.setattr(launcher, "trainer_starts_with_vllm", lambda cfg: early)
    real_wait = launcher.wait_http

    def wait_http(url, comp, timeout, what, watched=()):
        events.append(f"{comp.name} {what}")
        real_wait(url, comp, timeout, what, watched)  # answered at once: what it checks first is the exits

    monkeypatch.setattr(launcher, "wait_http", wait_http)
    monkeypatch.setattr(supervisor.httpx, "get", lambda url, timeout: httpx.Response(200))
    monkeypatch.setattr(launcher.time, "sleep", lambda s: None)
    comps = components(events, {"trainer": trainer_exit, "env": env_exit}, api_socket)
    launcher.start_all(comps, endpoints(), Path("run"))  # type: ignore[arg-type]
    return events


def test_the_trainer_loads_while_vllm_boots_where_they_share_no_gpu(monkeypatch):
    assert started(monkeypatch, early=True) == [
        "start run-api",
        "start gateway",
        "run-api answering /status",
        "start trainer",
        "start env",
        "gateway healthy",
    ]


def test_with_run_apis_socket_inherited_the_trainer_and_environments_start_beside_it(monkeypatch):
    assert started(monkeypatch, early=True, api_socket=True) == [
        "start run-api",
        "start gateway",
        "start trainer",
        "start env",
        "run-api answering /status",
        "gateway healthy",
    ]
    with pytest.raises(launcher.LaunchError, match="env exited with code 1 before the run-api was answering"):
        started(monkeypatch, early=True, env_exit=1, api_socket=True)
    # Sharing a GPU with vLLM, the trainer still waits for the gateway's health.
    assert started(monkeypatch, early=False, api_socket=True) == [
        "start run-api",
        "start gateway",
        "run-api answering /status",
        "gateway healthy",
        "start env",
        "start trainer",
    ]


def test_the_trainer_starts_last_where_it_may_share_vllms_gpu(monkeypatch):
    assert started(monkeypatch, early=False) == [
        "start run-api",
        "start gateway",
        "run-api answering /status",
        "gateway healthy",
        "start env",
        "start trainer",
    ]


def test_a_trainer_or_environment_that_died_while_vllm_booted_stops_the_start(monkeypatch):
    with pytest.raises(
        launcher.LaunchError, match="trainer exited with code 2 before the gateway was healthy"
    ):
        started(monkeypatch, early=True, trainer_exit=2)
    with pytest.raises(launcher.LaunchError, match="env exited with code 1 before the gateway was healthy"):
        started(monkeypatch, early=True, env_exit=1)
    with pytest.raises(launcher.LaunchError, match=r"env exited with code 1; read env\.log"):
        started(monkeypatch, early=False, env_exit=1)  # started after the gateway: seen a moment later


def test_only_a_local_trainer_on_a_cuda_machine_waits_for_vllm(monkeypatch, tmp_path):
    from trainer.orchestration import preflight

    cfg = load_config(RunConfig, None, [])
    control = tmp_path / "nvidiactl"
    monkeypatch.setattr(preflight, "NVIDIA_CONTROL", control)
    assert launcher.trainer_starts_with_vllm(cfg)  # no driver: the trainer runs on CPU
    control.touch()
    assert not launcher.trainer_starts_with_vllm(cfg)
    cfg.launch.backend = "tinker"  # Tinker samples: no vLLM on this machine
    assert launcher.trainer_starts_with_vllm(cfg)


class FakeProc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class Stoppable(FakeComponent):
    def __init__(self, name: str, events: list[str], exits_on_term: bool = True):
        super().__init__(name, events)
        self.proc, self.exits_on_term = FakeProc(), exits_on_term

    def terminate(self) -> None:
        self.events.append(f"stop {self.name}")
        if self.exits_on_term:
            self.proc.code = 0

    def exited(self) -> int | None:
        return self.proc.code


def test_the_trainer_is_stopped_first_and_given_its_time(monkeypatch):
    from trainer.orchestration import processes

    events: list[str] = []
    trainer = Stoppable("trainer", events)
    processes.stop_first(trainer, 5.0)  # type: ignore[arg-type]
    assert events == ["stop trainer"] and trainer.exited() == 0
    processes.stop_first(trainer, 5.0)  # type: ignore[arg-type]
    assert events == ["stop trainer"], "an exited trainer is left alone"
    stuck = Stoppable("trainer", events, exits_on_term=False)
    processes.stop_first(stuck, 0.3)  # type: ignore[arg-type]
    assert stuck.exited() is None, "past its time the others are stopped anyway (stop_all kills what is left)"


def restarted(monkeypatch, api_socket: bool) -> list[str]:
    """What Supervisor.restart does when the trainer died: run-api, the environment and the trainer again."""
    events: list[str] = []
    monkeypatch.setattr(supervisor, "stop_all", lambda group: events.append("stop the group"))
    monkeypatch.setattr(supervisor, "drain_backlog", lambda fd: 0)
    monkeypatch.setattr(
        supervisor,
        "wait_http",
        lambda url, comp, timeout, what, watched=(): events.append(f"{comp.name} {what}"),
    )
    comps = components(events, {}, api_socket)
    sup = supervisor.Supervisor(comps, endpoints(), Path("run"))  # type: ignore[arg-type]
    sup.restart([comps[0], comps[2], comps[3]])  # type: ignore[list-item]
    return events


def test_a_restart_starts_the_trainer_and_environments_beside_a_run_api_that_inherits_its_socket(monkeypatch):
    assert restarted(monkeypatch, api_socket=True) == [
        "stop the group",
        "start run-api",
        "start env",
        "start trainer",
        "run-api answering /status",
    ]
    assert restarted(monkeypatch, api_socket=False) == [
        "stop the group",
        "start run-api",
        "run-api answering /status",
        "start env",
        "start trainer",
    ]
