"""`python -m trainer export --push` against a stand-in hub (a local HTTP server speaking the routes huggingface_hub's
upload uses: create repo, YAML check, pre-upload, commit): every exported file arrives in one commit to a private
repo; no token, a refused upload and an unreachable hub are errors that say what to do, and commit nothing."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_export import write_run
from trainer.export import cli


class StandInHub:
    """Repos created (name -> private) and commits (repo -> {path: bytes}); `refuse` answers the commit 403."""

    def __init__(self) -> None:
        self.repos: dict[str, bool] = {}
        self.commits: list[tuple[str, dict[str, bytes]]] = []
        self.refuse = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                hub.answer(self, body)

            def do_GET(self) -> None:
                hub.answer(self, b"")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        path = handler.path.split("?")[0]
        if handler.headers.get("authorization") != "Bearer hf_standin":
            return self.reply(handler, 401, {"error": "Invalid credentials"})
        if path == "/api/repos/create":
            req = json.loads(body)
            repo = f"{req['organization']}/{req['name']}"
            self.repos[repo] = req.get("visibility", "private") == "private" or bool(req.get("private"))
            return self.reply(handler, 200, {"url": f"{self.url}/{repo}", "name": repo})
        if path == "/api/validate-yaml":
            return self.reply(handler, 200, {"errors": [], "warnings": []})
        parts = path.split("/")  # /api/models/<org>/<name>/<op>/<revision>
        if len(parts) == 7 and parts[:3] == ["", "api", "models"] and parts[5] == "preupload":
            files = json.loads(body)["files"]
            listing = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            return self.reply(handler, 200, {"files": listing, "commitOid": "0" * 40})
        if len(parts) == 7 and parts[:3] == ["", "api", "models"] and parts[5] == "commit":
            if self.refuse:
                return self.reply(
                    handler,
                    403,
                    {"error": "You don't have the rights to create a model under this namespace"},
                )
            files = {}
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo = f"{parts[3]}/{parts[4]}"
            self.commits.append((repo, files))
            sha = "c" * 40
            return self.reply(
                handler, 200, {"commitUrl": f"{self.url}/{repo}/commit/{sha}", "commitOid": sha}
            )
        self.reply(handler, 404, {"error": f"stand-in hub: no route {handler.command} {path}"})

    @staticmethod
    def reply(handler: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)


@pytest.fixture
def hub(monkeypatch) -> Iterator[StandInHub]:
    from huggingface_hub import constants

    stand_in = StandInHub()
    monkeypatch.setattr(constants, "ENDPOINT", stand_in.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the test command sets HF_HUB_OFFLINE=1
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    yield stand_in
    stand_in.server.shutdown()


def export_and_push(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    run = tmp_path / "run"
    if not run.exists():
        write_run(run, ["q_proj"], versions=1)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    return cli.main([str(run), "--out", str(out), "--push", "me/toy-rl", *extra]), out


def test_every_exported_file_arrives_in_one_commit_to_a_private_repo(hub, tmp_path):
    rc, out = export_and_push(tmp_path)
    assert rc == 0
    assert hub.repos == {"me/toy-rl": True}
    ((repo, files),) = hub.commits
    assert repo == "me/toy-rl"
    assert files == {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors"} == set(files)


def test_no_token_a_refusal_and_no_hub_are_clear_errors_that_commit_nothing(
    hub, tmp_path, capsys, monkeypatch
):
    hub.refuse = True
    rc, out = export_and_push(tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and "refused the upload to me/toy-rl (HTTP 403" in err and "nothing was committed" in err
    assert (out / "README.md").is_file() and f"the export in {out} is complete" in err
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf-home"))
    rc, _ = export_and_push(tmp_path)
    assert rc == 2 and "no Hugging Face token" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    rc, _ = export_and_push(tmp_path)
    assert rc == 2 and "could not be reached" in capsys.readouterr().err
    assert hub.commits == []
