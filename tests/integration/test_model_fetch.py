"""Pre-flight's model fetch against a stand-in hub (a local HTTP server speaking the few routes huggingface_hub
uses): a model not here is downloaded with its size said first, skipping Meta's original checkpoint; refusals
(gated, unknown, no disk, offline) say what to do; a dry run downloads nothing; a hub id never reaches the gateway.
Each check runs in a child process pointed at the stand-in (HF_ENDPOINT) and a temporary cache (HF_HOME)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.unit.test_memory_plan import LLAMA_8B  # Llama-3.1-8B's config.json, the keys the plan reads

ROOT = Path(__file__).resolve().parents[2]
# No server but the stand-in hub in the test's own process: runs beside the servers' tests (tests/run.sh).
pytestmark = pytest.mark.beside_servers
SHA = "0123456789abcdef0123456789abcdef01234567"
SHARDS = {"model-00001-of-00002.safetensors": b"A" * 3000, "model-00002-of-00002.safetensors": b"B" * 2000}
WEIGHT_MAP = {
    "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }
}
FETCHED = {
    "config.json": json.dumps(LLAMA_8B).encode(),
    "generation_config.json": b"{}",
    "model.safetensors.index.json": json.dumps(WEIGHT_MAP).encode(),
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    **SHARDS,
}
SKIPPED = {  # what a Llama/Mistral repo carries besides: never fetched
    "original/consolidated.00.pth": b"P" * 4000,
    "original/params.json": b"{}",
    "consolidated.safetensors": b"C" * 5000,
    "README.md": b"# model",
}


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    denial: dict[str, str] = field(
        default_factory=lambda: {"X-Error-Code": "GatedRepo"}
    )  # a bare 401 is seen too
    declared_sizes: dict[str, int] = field(default_factory=dict)  # what the listing claims, if not the truth

    def size(self, name: str) -> int:
        return self.declared_sizes.get(name, len(self.files[name]))


class StandInHub:
    """Model info, tree listing, auth check, and file resolve for the repos given; records every file GET."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.downloads: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = req.path.split("?")[0]
        if path == "/":
            return self.send(req, 200, b"hub", body)
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo_id, rest = "/".join(parts[:2]), parts[2:]
        repo = self.repos.get(repo_id)
        if repo is None:
            return self.send(req, 404, b"{}", body, {"X-Error-Code": "RepoNotFound"})
        if api:
            code, content, headers = self.api(repo_id, repo, rest)
            return self.send(req, code, content, body, headers)
        if repo.gated:
            return self.send(req, 403, b"{}", body, {"X-Error-Code": "GatedRepo"})
        name = "/".join(rest[2:])  # resolve/REVISION/NAME
        if body:
            self.downloads.append(name)
        content = repo.files[name]
        etag = hashlib.sha1(content).hexdigest()
        return self.send(req, 200, content, body, {"X-Repo-Commit": SHA, "ETag": f'"{etag}"'})

    def api(self, repo_id: str, repo: Repo, rest: list[str]) -> tuple[int, bytes, dict[str, str]]:
        if rest[:1] == ["auth-check"]:
            return (403 if repo.denial else 401, b"{}", repo.denial) if repo.gated else (200, b"{}", {})
        if rest[:1] == ["tree"]:
            tree = [
                {"type": "file", "path": n, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
                for n, c in repo.files.items()
            ]
            return 200, json.dumps(tree).encode(), {}
        siblings = [{"rfilename": n, "size": repo.size(n)} for n in repo.files]
        info = {"id": repo_id, "sha": SHA, "gated": "manual" if repo.gated else False, "siblings": siblings}
        return 200, json.dumps(info).encode(), {}

    @staticmethod
    def send(
        req: BaseHTTPRequestHandler,
        code: int,
        content: bytes,
        body: bool,
        headers: dict[str, str] | None = None,
    ) -> None:
        req.send_response(code)
        for key, value in {"Content-Length": str(len(content)), **(headers or {})}.items():
            req.send_header(key, value)
        req.end_headers()
        if body:
            req.wfile.write(content)


@pytest.fixture
def hub() -> Iterator[StandInHub]:
    stand_in = StandInHub(
        {
            "org/llama": Repo({**FETCHED, **SKIPPED}),
            "org/gated": Repo(dict(FETCHED), gated=True),
            "org/gated-401": Repo(dict(FETCHED), gated=True, denial={}),
            "org/huge": Repo(dict(FETCHED), declared_sizes={"model-00001-of-00002.safetensors": 10**18}),
        }
    )
    yield stand_in
    stand_in.server.shutdown()


def child_env(tmp_path: Path, hub: StandInHub | None, **extra: str) -> dict[str, str]:
    """The hub (or none: offline) and a cache of this test's own; never the user's token or cache."""
    drop = {
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_CACHE",
        "HF_ENDPOINT",
    }
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    if hub is None:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = hub.url
    return env


def run_check(tmp_path: Path, hub: StandInHub | None, call: str, **extra: str) -> tuple[int, str]:
    """`call` (e.g. check_model('org/llama')) in a child process: its exit code and its output."""
    code = (
        "import sys\n"
        "from trainer.training.config import ConfigError\n"
        "from trainer.orchestration.preflight import check_model, describe_model, fetch_model_config\n"
        f"try:\n    print('RESULT', {call}, flush=True)\n"
        "except ConfigError as exc:\n    print('REFUSED', exc)\n    sys.exit(2)\n"
    )
    env = child_env(tmp_path, hub, **extra)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    return proc.returncode, proc.stdout + proc.stderr


def result(out: str) -> str:
    return next(line.removeprefix("RESULT ") for line in out.splitlines() if line.startswith("RESULT "))


def test_a_model_not_here_is_downloaded_with_its_size_and_then_found_offline(tmp_path, hub):
    rc, out = run_check(tmp_path, hub, "check_model('org/llama')")
    assert rc == 0, out
    folder = Path(result(out))
    size = sum(len(c) for c in FETCHED.values())
    assert f"downloading org/llama: {size / 1e3:.2f} kB in {len(FETCHED)} files" in out, out
    assert str(tmp_path / "hf") in str(folder) and folder.is_dir()
    assert sorted(p.name for p in folder.iterdir()) == sorted(FETCHED)
    assert (folder / "model-00002-of-00002.safetensors").read_bytes() == SHARDS[
        "model-00002-of-00002.safetensors"
    ]
    assert not set(SKIPPED) & set(hub.downloads), hub.downloads
    rc, again = run_check(tmp_path, None, "check_model('org/llama')")  # offline now: the cache serves it
    assert rc == 0 and result(again) == str(folder), again


def test_a_cache_holding_config_json_alone_is_not_taken_for_the_model(tmp_path, hub):
    """The memory plan fetches config.json alone; that snapshot must not pass for the downloaded model."""
    rc, out = run_check(tmp_path, hub, "fetch_model_config('org/llama')['hidden_size']")
    assert rc == 0 and result(out) == str(LLAMA_8B["hidden_size"]), out
    rc, out = run_check(tmp_path, None, "check_model('org/llama')")
    assert rc == 2 and "hf download org/llama" in out, out
    rc, out = run_check(tmp_path, hub, "check_model('org/llama')")
    assert rc == 0 and "1 more already cached" in out, out
    assert "config.json" not in hub.downloads[1:]  # the cached file is not fetched again
    assert (Path(result(out)) / "model-00001-of-00002.safetensors").is_file()


def test_a_download_that_does_not_fit_the_disk_is_refused_with_numbers_before_any_byte(tmp_path, hub):
    rc, out = run_check(tmp_path, hub, "check_model('org/huge')")
    assert rc == 2, out
    assert "needs 1000000000.00 GB" in out and "GB is free there" in out and "HF_HUB_CACHE" in out, out
    assert hub.downloads == []


def test_a_gated_model_without_access_names_the_token_and_the_licence_page(tmp_path, hub):
    rc, out = run_check(tmp_path, hub, "check_model('org/gated')")
    assert rc == 2, out
    assert "gated" in out and "no Hugging Face token is set" in out, out
    assert "HF_TOKEN" in out and "hf auth login" in out and f"{hub.url}/org/gated" in out, out
    rc, out = run_check(tmp_path, hub, "check_model('org/gated')", HF_TOKEN="hf_" + "x" * 30)
    assert rc == 2 and "an account without access" in out and "x" * 30 not in out, out
    rc, out = run_check(
        tmp_path, hub, "check_model('org/gated-401')"
    )  # a denial without the hub's error code
    assert rc == 2 and "gated" in out and "HF_TOKEN" in out and "no such model" not in out, out
    assert hub.downloads == []


def test_an_unknown_model_is_said_to_be_unknown(tmp_path, hub):
    rc, out = run_check(tmp_path, hub, "check_model('org/no-such-model')")
    assert rc == 2 and "no such model on the hub" in out, out


def test_offline_the_refusal_gives_a_download_command_that_the_installed_cli_runs(tmp_path, hub):
    rc, out = run_check(tmp_path, None, "check_model('org/llama')")
    assert rc == 2 and "model.path=/path/to/folder" in out and "HF_HUB_CACHE" in out, out
    command = out[out.index("`hf download") + 1 :].split("`")[0]
    argv = [str(Path(sys.executable).parent / "hf"), *shlex.split(command)[1:], "--dry-run"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=child_env(tmp_path, hub), timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in FETCHED:
        assert name in proc.stdout, (name, proc.stdout)
    for name in SKIPPED:
        assert name not in proc.stdout, (name, proc.stdout)


def test_a_dry_run_says_what_a_launch_downloads_plans_memory_and_downloads_nothing(tmp_path, hub):
    argv = [
        sys.executable,
        "-m",
        "trainer.orchestration.launcher",
        "gsm8k",
        "--dry-run",
        "model.path=org/llama",
    ]
    argv += [f"trainer.output_dir={tmp_path / 'run'}", "launch.gpu_memory_gib=80"]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=child_env(tmp_path, hub), cwd=ROOT, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    size = sum(len(c) for c in FETCHED.values())
    assert f"# model: not here; a launch first downloads org/llama: {size / 1e3:.2f} kB" in proc.stdout
    assert "# memory plan" in proc.stdout and "on one 80.00 GiB GPU" in proc.stdout, proc.stdout
    assert hub.downloads == ["config.json"]  # the plan's config alone, as before: no weights
    assert not list((tmp_path / "hf").rglob("*.safetensors")) and not (tmp_path / "run").exists()


def test_a_launch_writes_the_downloaded_folder_never_the_hub_id_into_the_run_configs(tmp_path, hub):
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from trainer.orchestration.launcher import preflight, write_run_folder\n"
        "from trainer.training.config import RunConfig, load_config\n"
        "run = Path(sys.argv[1])\n"
        "cfg = load_config(RunConfig, 'configs/tiny_cpu.yaml', ['model.path=org/llama', f'trainer.output_dir={run}'])\n"
        "write_run_folder(cfg, run, preflight(cfg), None)\n"
    )
    run = tmp_path / "run"
    env = child_env(tmp_path, hub)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    gateway = yaml.safe_load((run / "gateway.yaml").read_text())
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert Path(gateway["model"]).is_dir() and gateway["model"] == config["model"]["path"], gateway["model"]
    assert (Path(gateway["model"]) / "model-00001-of-00002.safetensors").is_file()
