"""What a crash at any point leaves in a run folder, and the repair a restarted trainer makes; the trainer's retries
of run-api and the gateway. Each crash state is built on disk exactly as the interrupted write leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from trainer.training.checkpoints import (
    LATEST,
    LoopState,
    read_latest,
    repair,
    write_loop_state,
)
from trainer.training.config import RunConfig, load_config
from trainer.training.faults import fault_counts
from trainer.training.retries import ComponentDown, RemoteComponent, checked
from trainer.training.runapi_client import RunApi


def make_checkpoint(run: Path, step: int, version: int, loop_state: bool = True, latest: bool = True) -> None:
    (run / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    (run / "checkpoints" / f"step-{step:06d}" / "trainer_state.pt").write_bytes(b"x")
    if loop_state:
        state = {"step": step, "version": version}
        (run / "checkpoints" / f"step-{step:06d}.loop.json").write_text(json.dumps(state))
    if latest:
        (run / "checkpoints" / LATEST).write_text(f"step-{step:06d}")


def make_adapters(run: Path, *versions: int) -> None:
    for v in versions:
        (run / "adapters" / f"v{v:06d}").mkdir(parents=True)


def write_metrics(run: Path, steps: range, torn: bool = False) -> None:
    text = "".join(json.dumps({"step": s}) + "\n" for s in steps)
    (run / "metrics.jsonl").write_text(text + ('{"step": 9' if torn else ""))


def steps_in_metrics(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_crash_before_the_first_checkpoint_starts_clean(tmp_path):
    """The trainer killed at step 3: adapters v1..v3 and rows 1..3 exist, no checkpoint (the run used to be
    unresumable: `adapters/v000001 exists`)."""
    make_adapters(tmp_path, 1, 2, 3)
    (tmp_path / "adapters" / ".v000004.tmp-4242").mkdir()  # killed during an adapter save
    write_metrics(tmp_path, range(1, 4))
    fixed = repair(tmp_path)
    assert fixed.checkpoint is None and fixed.state is None
    assert not list((tmp_path / "adapters").glob("v*")) and not list((tmp_path / "adapters").glob(".*"))
    (aside,) = (tmp_path / "adapters").glob("discarded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["v000001", "v000002", "v000003"]
    assert steps_in_metrics(tmp_path) == [] and fixed.metrics_rows_dropped == 3


def test_crash_between_checkpoint_rename_and_latest(tmp_path):
    """step-15 renamed into place (with or without its loop state) but `latest` still names step-10: the newer
    folder is set aside and step 10 resumes (it used to block every resume: `checkpoint step-15 exists`)."""
    make_checkpoint(tmp_path, 10, 7)
    make_checkpoint(tmp_path, 15, 11, latest=False)
    make_checkpoint(tmp_path, 20, 12, loop_state=False, latest=False)
    (tmp_path / "checkpoints" / ".step-000025.tmp-99").mkdir()
    (tmp_path / "checkpoints" / ".latest.tmp-99").write_text("step-0000")
    make_adapters(tmp_path, *range(1, 13))
    write_metrics(tmp_path, range(1, 17), torn=True)
    fixed = repair(tmp_path)
    assert fixed.state == LoopState(step=10, version=7)
    assert fixed.checkpoint == tmp_path / "checkpoints" / "step-000010"
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("discarded")) == [
        LATEST,
        "step-000010",
        "step-000010.loop.json",
    ]
    (aside,) = ckpts.glob("discarded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-000015", "step-000015.loop.json", "step-000020"]
    assert sorted(p.name for p in (tmp_path / "adapters").glob("v*")) == [f"v{v:06d}" for v in range(1, 8)]
    assert steps_in_metrics(tmp_path) == list(range(1, 11))
    assert len(fixed.swept or []) == 2


def test_latest_naming_a_missing_checkpoint_falls_back_to_the_newest_complete_one(tmp_path):
    make_checkpoint(tmp_path, 5, 4)
    make_checkpoint(tmp_path, 10, 8, loop_state=False)  # latest -> step-10, whose loop state never landed
    assert read_latest(tmp_path) is None
    fixed = repair(tmp_path)
    assert fixed.state == LoopState(5, 4)


def test_write_loop_state_moves_latest_last(tmp_path):
    (tmp_path / "checkpoints" / "step-000004").mkdir(parents=True)
    write_loop_state(tmp_path, LoopState(4, 3))
    found = read_latest(tmp_path)
    assert found is not None and found[1] == LoopState(4, 3)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if ".tmp-" in p.name]


def test_fault_counts_read_the_launchers_file(tmp_path):
    assert fault_counts(tmp_path, 0)["faults/restarts_trainer"] == 0.0
    (tmp_path / "faults.json").write_text(json.dumps({"restarts_trainer": 2, "restarts_vllm": 1}))
    counts = fault_counts(tmp_path, 1)
    assert counts["faults/restarts_trainer"] == 2.0 and counts["faults/restarts_vllm"] == 1.0
    assert counts["faults/run_api_reregistrations"] == 1.0


# --- retries ------------------------------------------------------------------------------------------------


def flaky(responses: list[int | Exception]) -> tuple[httpx.Client, list[str]]:
    """A client whose server answers with each status (or raises each exception) in turn."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        item = responses.pop(0) if len(responses) > 1 else responses[0]
        if isinstance(item, Exception):
            raise item
        return httpx.Response(item, json={"batch": None})

    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://run-api"), seen


def test_transient_failures_are_retried_until_an_answer():
    client, seen = flaky([httpx.ConnectError("refused"), 503, httpx.ReadTimeout("slow"), 502, 200])
    edge = RemoteComponent("run-api", "http://run-api", "logs/run-api.log", budget_s=30, max_wait_s=0.01)
    assert edge.call(lambda: checked(client.get("/batch")), "/batch").status_code == 200
    assert len(seen) == 5


def test_a_4xx_is_never_retried():
    client, seen = flaky([422])
    edge = RemoteComponent("gateway", "http://gw", "logs/gateway.log", budget_s=30, max_wait_s=0.01)
    with pytest.raises(httpx.HTTPStatusError, match="422"):
        edge.call(lambda: checked(client.get("/policy")), "/policy")
    assert len(seen) == 1


def test_past_the_budget_the_error_names_component_url_and_log():
    client, seen = flaky([httpx.ConnectError("refused")])
    edge = RemoteComponent(
        "run-api", "http://127.0.0.1:9", "RUN/logs/run-api.log", budget_s=0.3, max_wait_s=0.05
    )
    with pytest.raises(
        ComponentDown, match=r"run-api at http://127.0.0.1:9: /batch .*read RUN/logs/run-api.log"
    ):
        edge.call(lambda: checked(client.get("/batch")), "/batch")
    assert len(seen) >= 2


def test_run_api_restarted_is_registered_with_again_at_the_current_step(tmp_path):
    cfg = load_config(RunConfig, None, [f"trainer.output_dir={tmp_path}"])
    registered: list[int] = []
    answers = [{"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/register":
            registered.append(json.loads(request.content)["starting_step"])
            return httpx.Response(200, json={"uuid": 1})
        return httpx.Response(200, json=answers.pop(0) if answers else {"batch": [{"tokens": [[1]]}]})

    api = RunApi(cfg, "http://run-api", "run-api.log")
    api._http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://run-api")
    api.register(0)
    api.step = 12
    assert api.fetch_batch() is None  # the restarted run-api's answer
    assert registered == [0, 12] and api.reregistrations == 1
    assert api.fetch_batch() == [{"tokens": [[1]]}]


def test_a_run_api_that_never_takes_the_registration_is_an_error_not_a_spin(tmp_path):
    """run-api given scored data before any registration ignores every later one: the trainer says so and exits,
    and the launcher's restart of the trainer (with run-api) clears it."""
    cfg = load_config(RunConfig, None, [f"trainer.output_dir={tmp_path}"])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/register":
            return httpx.Response(200, json={"uuid": 1})
        return httpx.Response(
            200, json={"status": "error", "message": "Trainer not registered.", "batch": []}
        )

    api = RunApi(cfg, "http://run-api", "logs/run-api.log")
    api._http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://run-api")
    with pytest.raises(RuntimeError, match=r"still answers 'not registered'.*logs/run-api.log"):
        for _ in range(10):
            api.fetch_batch()


def test_connections_left_for_a_dead_server_are_dropped_not_handed_to_its_successor():
    import socket

    from trainer.orchestration.processes import drain_backlog, listen

    server = listen("127.0.0.1")
    port = server.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    for c in clients:
        c.sendall(b"POST /scored_data HTTP/1.1\r\n\r\n")
    assert drain_backlog(server.fileno()) == 2
    fresh = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()  # still a blocking, working listener for the next run-api
    assert conn.getblocking()
    for s in (*clients, fresh, conn, server):
        s.close()


def test_a_fresh_run_too_big_for_the_disk_is_warned_about_at_start(tmp_path, caplog):
    from types import SimpleNamespace

    from trainer.training.recovery import warn_if_disk_short

    cfg = load_config(RunConfig, None, [f"trainer.output_dir={tmp_path}", "rollout.num_steps=100"])
    huge = SimpleNamespace(numel=lambda: 10**15, requires_grad=True)  # 4 PB of adapter per version
    backend = SimpleNamespace(model=SimpleNamespace(parameters=lambda: [huge]))
    warn_if_disk_short(cfg, backend, tmp_path, LoopState())  # type: ignore[arg-type]
    assert "bytes free; the remaining 100 steps will write" in caplog.text
    caplog.clear()
    small = SimpleNamespace(
        model=SimpleNamespace(parameters=lambda: [SimpleNamespace(numel=lambda: 10, requires_grad=True)])
    )
    warn_if_disk_short(cfg, small, tmp_path, LoopState())  # type: ignore[arg-type]
    assert caplog.text == ""


def test_environments_register_once_the_trainer_has_registered_and_opened_run_api(tmp_path):
    """Atropos's own run-api (in process) refuses an environment until the trainer's first GET /batch: a fresh run
    registers and opens it before vLLM is up, so its environments register and pause meanwhile. A batch that was
    already there is not lost: the loop's first fetch gets it."""
    from atroposlib.api.server import app
    from fastapi.testclient import TestClient

    cfg = load_config(RunConfig, None, [f"trainer.output_dir={tmp_path}"])
    env = {"max_token_length": 256, "desired_name": "toy", "weight": 1.0, "group_size": 2}
    with TestClient(app) as client:
        try:
            api = RunApi(cfg, "http://testserver", "run-api.log")
            api._http = client
            api.register(0)
            assert client.post("/register-env", json=env).json() == {"status": "wait for trainer to start"}
            api.open_to_environments()
            assert "env_id" in client.post("/register-env", json=env).json()
            assert api.fetch_batch() is None  # nothing sent yet
        finally:
            client.get("/reset_data")

    held = [{"tokens": [[1]]}]
    answers = [{"batch": held}, {"batch": None}]
    api = RunApi(cfg, "http://run-api", "run-api.log")
    api._http = httpx.Client(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, json=answers.pop(0))),
        base_url="http://run-api",
    )
    api.open_to_environments()
    assert api.fetch_batch() == held and api.fetch_batch() is None and not answers
