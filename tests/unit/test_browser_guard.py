"""rlcommon/browser_guard.py on the gateway and the Tinker-protocol service: a web page can neither write to them
(another site's Origin, a form content type) nor read them through a DNS name pointed at 127.0.0.1; programs (no
Origin, JSON) are served as before."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import MagicMock

import httpx
import pytest

from rlcommon.browser_guard import refusal
from tests.scripted_gateway import ScriptedBackend, client_for, make_adapter, publish_body
from trainer.service.routes import build_app
from trainer.training.config import RunConfig

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    "method,headers,status",
    [
        ("GET", {"host": "127.0.0.1:8000"}, None),
        ("GET", {"host": "localhost"}, None),
        ("GET", {"host": "[::1]:9"}, None),
        ("GET", {"host": "rebound.attacker.example:8000"}, 403),
        ("GET", {}, 403),
        ("POST", {"host": "127.0.0.1:8000", **JSON}, None),
        ("POST", {"host": "127.0.0.1:8000"}, None),  # no content type: a program (a page sends an Origin)
        ("POST", {"host": "127.0.0.1:8000", "content-type": "application/x-protobuf"}, None),
        ("POST", {"host": "127.0.0.1:8000", "content-type": "text/plain;charset=UTF-8"}, 415),
        ("POST", {"host": "127.0.0.1:8000", "content-type": "application/x-www-form-urlencoded"}, 415),
        ("PUT", {"host": "127.0.0.1:8000", "content-type": "multipart/form-data; boundary=x"}, 415),
        ("POST", {"host": "127.0.0.1:8000", "origin": "http://evil.example", **JSON}, 403),
        ("DELETE", {"host": "127.0.0.1:8000", "origin": "null"}, 403),
        (
            "POST",
            {"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:8000", **JSON},
            None,
        ),  # its own origin
        ("GET", {"host": "127.0.0.1:8000", "origin": "http://evil.example"}, None),  # reads: the Host rule
    ],
)
def test_what_a_page_could_send_is_refused_and_what_programs_send_is_not(method, headers, status):
    got = refusal(method, headers, loopback_only=True)
    assert (got[0] if got else None) == status, got


def test_a_server_bound_beyond_loopback_takes_any_host_but_still_no_page_writes():
    assert refusal("GET", {"host": "node17:8000"}, loopback_only=False) is None
    assert refusal("POST", {"host": "node17:8000", "origin": "http://evil.example"}, loopback_only=False)


async def test_a_page_cannot_publish_gate_or_read_the_gateway(tmp_path: Path):
    backend = ScriptedBackend()
    client, registry = client_for(backend)
    adapter = make_adapter(tmp_path, "v1")
    async with client:
        # The reproduction: a cross-origin text/plain publish of any folder.
        r = await client.post(
            "/policy/publish",
            content=json.dumps(publish_body(1, adapter)).encode(),
            headers={"origin": "http://evil.example", "content-type": "text/plain"},
        )
        assert r.status_code == 403 and r.json()["error"]["type"] == "from_web_page", r.text
        r = await client.post("/policy/publish", json=publish_body(1, adapter), headers={"origin": "null"})
        assert r.status_code == 403
        r = await client.post(
            "/policy/expect", content=b'{"version": 1}', headers={"content-type": "text/plain"}
        )
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
        assert registry.current.version == 0 and not backend.loaded  # nothing was published or loaded
        # DNS rebinding: the page's own name for 127.0.0.1 reads nothing (vLLM's URL and PIDs are in /policy).
        r = await client.get("/policy", headers={"host": "rebound.attacker.example"})
        assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]
        # Programs: no Origin, JSON.
        assert (await client.get("/policy")).status_code == 200
        r = await client.post("/policy/publish", json=publish_body(1, adapter))
        assert r.status_code == 200, r.text
        # A generation route's refusal is counted by its reason, as every refusal of those routes is.
        body = {"prompt": {"prompt_token_ids": [5, 6]}, "n": 1, "max_tokens": 2}
        r = await client.post("/generate", json=body, headers={"origin": "https://evil.example"})
        assert r.status_code == 403
        counts = (await client.get("/policy")).json()["rejected_by_reason"]
        assert counts.get("from_web_page") == 1, counts


async def test_a_page_cannot_drive_the_tinker_protocol_service(tmp_path: Path):
    cfg = RunConfig.model_validate({"trainer": {"output_dir": str(tmp_path)}})
    app = build_app(cfg, MagicMock())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as client:
        r = await client.post(
            "/api/v1/create_session",
            content=b"{}",
            headers={"origin": "http://evil.example", "content-type": "text/plain"},
        )
        assert r.status_code == 403 and "evil.example" in r.json()["detail"]
        r = await client.post("/api/v1/create_session", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 415
        r = await client.get("/health", headers={"host": "rebound.attacker.example:8100"})
        assert r.status_code == 403
        assert (await client.get("/api/v1/healthz")).status_code == 200


def test_the_service_refuses_an_open_bind_and_keeps_its_key_off_the_command_line(tmp_path, monkeypatch):
    from trainer.orchestration import service_launch
    from trainer.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"service.host='0.0.0.0' exposes the service.*service.api_key"):
        load_config(RunConfig, None, ["service.host=0.0.0.0"])
    with pytest.raises(ConfigError, match="of 8 characters"):
        load_config(RunConfig, None, ["service.host=0.0.0.0", "service.api_key=tml-1234"])
    started: list[list[str]] = []

    class Proc:
        def __init__(self, argv: list[str], **_: object) -> None:
            started.append(argv)

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(service_launch.subprocess, "Popen", Proc)
    monkeypatch.setattr(service_launch, "supervise", lambda *a: 0)
    monkeypatch.setattr(service_launch, "stop_child", lambda *a, **k: None)
    key = "tml-secret-0123456789abcdef"
    args = [f"service.output_dir={tmp_path}", "service.sampling=false", f"service.api_key={key}"]
    assert service_launch.main(args) == 0
    (argv,) = started
    assert not any(key in a for a in argv), argv
    config = tmp_path / "logs" / "service.yaml"
    assert argv[-2:] == ["--config", str(config)] and key in config.read_text()
    assert config.stat().st_mode & 0o777 == 0o600
