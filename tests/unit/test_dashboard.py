"""The live dashboard's server in-process (FastAPI's TestClient): what it lists, the rows a poller gets after the
ones it holds, the bound on points per series, folders read as they are, and the token rule off loopback."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainer.readout.dashboard import MIN_TOKEN_CHARS, bind_error, create_app, open_socket
from trainer.readout.dashboard import main as dashboard_main
from trainer.readout.dashboard_data import MAX_POINTS

LOCAL = "http://127.0.0.1"


def write_rows(path: Path, rows: list[dict[str, Any]], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + tail)


def step_row(step: int, reward: float = 0.5) -> dict[str, Any]:
    return {"step": step, "wall_s": float(step), "unix_time": 1e9 + step, "reward/mean": reward, "loss": -0.1}


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    write_rows(root / "toy-a" / "metrics.jsonl", [step_row(s) for s in range(1, 4)])
    (root / "toy-a" / "config.yaml").write_text(
        "model:\n  path: tiny\ninference:\n  publish_token: s3cr3t-s3cr3t\n"
    )
    (root / "toy-b").mkdir()
    (root / "toy-b" / "config.yaml").write_text("model: {path: tiny}\n")  # started, no step yet
    (root / "notes").mkdir()  # neither a run nor a client
    for n in range(2):
        calls = [{"call": "forward_backward", "loss": 2.0 / (i + 1), "seconds": 0.1} for i in range(3)]
        write_rows(root / "service" / f"s0_train_{n}" / "metrics.jsonl", calls)
    return root


def client(root: Path, token: str | None = None) -> TestClient:
    return TestClient(create_app([root], token), base_url=LOCAL)


def test_lists_runs_and_service_clients(runs: Path) -> None:
    got = client(runs).get("/api/sources").json()["sources"]
    assert {(s["id"], s["kind"]) for s in got} == {
        ("0:toy-a", "run"),
        ("0:toy-b", "run"),
        ("0:service/s0_train_0", "client"),
        ("0:service/s0_train_1", "client"),
    }
    page = client(runs).get("/")
    assert page.status_code == 200 and "static/app.js" in page.text
    assert "canvas" in client(runs).get("/static/app.js").text


def test_service_clients_have_their_loss_curves(runs: Path) -> None:
    c = client(runs)
    for n in range(2):
        got = c.get("/api/series", params={"id": f"0:service/s0_train_{n}"}).json()
        assert got["kind"] == "client"
        assert got["series"]["loss"] == [[1.0, 2.0, 3.0], [2.0, 1.0, 2.0 / 3]]
    assert (
        c.get("/api/facts", params={"id": "0:service/s0_train_1"}).json()["summary"]["loss_last"] == 2.0 / 3
    )


def test_a_poller_gets_only_the_rows_it_lacks(runs: Path) -> None:
    c = client(runs)
    first = c.get("/api/series", params={"id": "0:toy-a"}).json()
    assert first["since"] == 0 and first["rows"] == 3
    assert first["series"]["reward/mean"][0] == [1.0, 2.0, 3.0]
    write_rows(runs / "toy-a" / "metrics.jsonl", [step_row(4, 0.9)])
    more = c.get("/api/series", params={"id": "0:toy-a", "since": 3, "key": first["key"]}).json()
    assert more["since"] == 3 and more["rows"] == 4
    assert more["series"]["reward/mean"] == [[4.0], [0.9]]
    # Nothing new: no points. A file now shorter than what the poller saw (rewritten): everything from row 0.
    assert c.get("/api/series", params={"id": "0:toy-a", "since": 4}).json()["series"] == {}
    again = c.get("/api/series", params={"id": "0:toy-a", "since": 9}).json()
    assert again["since"] == 0 and len(again["series"]["reward/mean"][0]) == 4


def test_eval_rows_come_beside_the_training_rows(runs: Path) -> None:
    write_rows(runs / "toy-a" / "eval.jsonl", [{"step": 2, "unix_time": 1e9 + 2, "eval/pass@1": 0.25}])
    got = client(runs).get("/api/series", params={"id": "0:toy-a", "eval_since": 0}).json()
    assert got["eval_series"] == {"eval/pass@1": [[2.0], [0.25]]} and got["eval_rows"] == 1
    assert (
        client(runs).get("/api/series", params={"id": "0:toy-a", "eval_since": 1}).json()["eval_series"] == {}
    )


def test_a_long_run_is_thinned_and_keeps_its_spike(tmp_path: Path) -> None:
    rows = [step_row(s, 0.5) for s in range(1, 10_001)]
    rows[7000]["reward/mean"] = 9.0
    write_rows(tmp_path / "long" / "metrics.jsonl", rows)
    got = client(tmp_path).get("/api/series", params={"id": "0:long"}).json()
    xs, ys = got["series"]["reward/mean"]
    assert len(xs) <= MAX_POINTS and 9.0 in ys and xs == sorted(xs)


def test_a_file_past_the_rows_held_is_read_in_chunks_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 GB metrics.jsonl (a long run) parsed whole took its size several times over in memory. Here 30,000 rows
    with the dashboard holding 1,000: the file is read in 1 MB chunks, the rows are thinned as they come, and the
    newest row is still the page's."""
    import tracemalloc

    from trainer.readout import dashboard_data

    monkeypatch.setattr(dashboard_data, "MAX_ROWS", 1000)
    monkeypatch.setattr(dashboard_data, "READ_CHUNK_BYTES", 1 << 20)
    path = tmp_path / "long" / "metrics.jsonl"
    pad = {f"x/{k}": 0.25 for k in range(4)}
    write_rows(path, [{**step_row(s), **pad} for s in range(1, 30_001)])
    reader = dashboard_data.Reader()
    tracemalloc.start()
    metrics, key = reader.metrics(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"peak {peak / 2**20:.1f} MiB")
    assert len(metrics.rows) <= 1001 and metrics.rows[-1]["step"] == 30_000
    steps = [r["step"] for r in metrics.rows]
    assert (
        steps == sorted(steps) and steps[0] <= 64 and steps[len(steps) // 2] > 10_000
    )  # spread over the file
    assert any("30000 rows; 1 in 32 is shown" in p for p in metrics.problems), metrics.problems
    assert peak < 12 << 20, peak  # chunks and held rows (42 MiB when every row was held)
    write_rows(path, [step_row(30_001)])
    grown, grown_key = reader.metrics(path)
    assert grown.rows[-1]["step"] == 30_001 and grown_key == key  # stride unchanged: a poller appends
    got = client(tmp_path).get("/api/series", params={"id": "0:long"}).json()
    assert got["rows"] <= 1001 and max(got["series"]["reward/mean"][0]) == 30_001


def test_half_written_and_missing_files_are_shown_not_failed(runs: Path) -> None:
    write_rows(runs / "toy-a" / "metrics.jsonl", [], tail='{"step": 4, "rew')
    c = client(runs)
    got = c.get("/api/series", params={"id": "0:toy-a"}).json()
    assert got["rows"] == 3 and any("half-written" in p for p in got["problems"])
    write_rows(runs / "toy-a" / "metrics.jsonl", [], tail='ard/mean": 0.7}\n')  # the writer finishes the line
    assert c.get("/api/series", params={"id": "0:toy-a", "since": 3}).json()["series"]["reward/mean"] == [
        [4.0],
        [0.7],
    ]
    empty = c.get("/api/series", params={"id": "0:toy-b"})
    assert empty.status_code == 200 and empty.json()["series"] == {}
    facts = c.get("/api/facts", params={"id": "0:toy-b"}).json()
    assert facts["checkpoints"]["latest_checkpoint"] is None and facts["faults"] == {}
    assert any("no metrics.jsonl" in p for p in facts["problems"])
    (runs / "toy-b" / "faults.json").write_text("{not json")
    assert any("faults.json" in p for p in c.get("/api/facts", params={"id": "0:toy-b"}).json()["problems"])
    for bad in ("0:notes", "0:../runs/toy-a", "1:toy-a", "toy-a", "0:gone"):
        assert c.get("/api/series", params={"id": bad}).status_code == 404, bad


def test_config_is_shown_with_secrets_hidden(runs: Path) -> None:
    facts = client(runs).get("/api/facts", params={"id": "0:toy-a"}).json()
    assert "path: tiny" in facts["config"] and "publish_token: <hidden>" in facts["config"]
    assert "s3cr3t" not in json.dumps(facts)


def test_a_token_is_required_off_loopback_and_checked(runs: Path) -> None:
    assert "--token" in (bind_error("0.0.0.0", None) or "")
    assert f"at least {MIN_TOKEN_CHARS}" in (bind_error("0.0.0.0", "short") or "")
    assert bind_error("0.0.0.0", "x" * MIN_TOKEN_CHARS) is None
    assert bind_error("127.0.0.1", None) is None and bind_error("::1", None) is None
    assert dashboard_main(["--host", "192.168.0.7"]) == 2  # refused before binding anything
    # An inherited socket is judged by where it is bound, whatever --host says.
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        assert "--token" in str(open_socket("127.0.0.1", 0, os.dup(sock.fileno()), None))
    token = "t" * 20
    c = TestClient(create_app([runs], token, loopback_only=False), base_url="http://10.1.2.3")
    assert c.get("/api/sources").status_code == 401
    assert c.get("/").status_code == 401
    assert c.get("/api/sources", headers={"Authorization": "Bearer " + "u" * 20}).status_code == 401
    assert c.get("/api/sources", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert c.get("/", params={"token": token}).status_code == 200
    assert c.get("/static/app.js").status_code == 200  # the shipped script holds nothing of the runs


def test_without_a_token_only_loopback_names_are_answered(runs: Path) -> None:
    assert client(runs).get("/api/sources").status_code == 200
    other = TestClient(create_app([runs]), base_url="http://attacker.example")
    assert other.get("/api/sources").status_code == 403


def test_the_launcher_starts_the_dashboard_on_a_socket_it_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.orchestration import dashboard_launch
    from trainer.training.config import RunConfig

    started: list[Any] = []
    monkeypatch.setattr(dashboard_launch.Component, "start", lambda self: started.append(self))
    assert dashboard_launch.start_dashboard(RunConfig(), tmp_path) is None  # off by default
    on = SimpleNamespace(launch=SimpleNamespace(dashboard=True))  # until the config defines launch.dashboard
    comp = dashboard_launch.start_dashboard(on, tmp_path)  # type: ignore[arg-type]
    assert comp is not None and started == [comp]
    assert comp.argv[1:5] == ["-m", "trainer", "dashboard", str(tmp_path)]
    assert (
        comp.argv[5:] == ["--fd", str(comp.pass_fds[0])] and comp.log == tmp_path / "logs" / "dashboard.log"
    )
    assert capsys.readouterr().out.startswith("dashboard: http://127.0.0.1:")


@pytest.mark.parametrize("source_id", ["0:" + "x" * 300, "²:x", "9" * 5000 + ":x", "0:a/" + "y" * 4000])
def test_crafted_ids_are_a_404_not_a_server_error(runs: Path, source_id: str) -> None:
    c = TestClient(create_app([runs]), base_url=LOCAL, raise_server_exceptions=False)
    for route in ("/api/facts", "/api/series"):
        r = c.get(route, params={"id": source_id})
        assert r.status_code == 404, (route, r.status_code, r.text[:200])


def test_a_fifo_or_a_link_to_a_device_is_named_not_read(tmp_path: Path) -> None:
    """A FIFO as metrics.jsonl blocked the reading threads until the server stopped answering; a link to /dev/zero
    read until memory ran out. Both are now refused by kind, at once."""
    root = tmp_path / "runs"
    (root / "fifo").mkdir(parents=True)
    os.mkfifo(root / "fifo" / "metrics.jsonl")
    (root / "fifo" / "config.yaml").write_text("model: {path: tiny}\n")
    (root / "zero").mkdir()
    (root / "zero" / "metrics.jsonl").symlink_to("/dev/zero")
    os.mkfifo(root / "zero" / "config.yaml")
    (root / "zero" / "faults.json").symlink_to("/dev/zero")
    c = client(root)
    ids = {s["id"] for s in c.get("/api/sources").json()["sources"]}
    assert ids == {"0:fifo", "0:zero"}
    for source_id in ids:
        series = c.get("/api/series", params={"id": source_id}).json()
        assert series["rows"] == 0 and any("not a regular file" in p for p in series["problems"]), series
        facts = c.get("/api/facts", params={"id": source_id})
        assert facts.status_code == 200, facts.text


def test_parallel_polls_of_a_growing_file_each_see_whole_rows(tmp_path: Path) -> None:
    """The server answers polls on several threads: they shared one reader's tail without a lock, and 8 parallel
    polls of a growing file answered 500s and row counts past the file's."""
    import threading

    root = tmp_path / "runs"
    path = root / "run" / "metrics.jsonl"
    write_rows(path, [step_row(s) for s in range(1, 101)])
    c = client(root)
    errors: list[str] = []
    counts: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        step = 101
        while not stop.is_set() and step < 3000:
            write_rows(path, [step_row(s) for s in range(step, step + 20)])
            step += 20

    def poller() -> None:
        for _ in range(15):
            r = c.get("/api/series", params={"id": "0:run"})
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:100]}")
                continue
            counts.append(r.json()["rows"])

    w = threading.Thread(target=writer)
    w.start()
    polls = [threading.Thread(target=poller) for _ in range(8)]
    for t in polls:
        t.start()
    for t in polls:
        t.join()
    stop.set()
    w.join()
    lines = len(path.read_text().splitlines())
    assert not errors, errors[:3]
    assert counts and max(counts) <= lines, (max(counts), lines)
