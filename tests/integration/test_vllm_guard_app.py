"""vLLM's own app (built, not served, from the command line the gateway starts, which imports vLLM: ~20 s):
every route it has, the SageMaker ones included, answers 401 without the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from inference.config import GatewayConfig
from inference.samplers.vllm_command import VLLM_GUARD_MIDDLEWARE, build_vllm_command

# Builds vLLM's app in a child and serves nothing: runs beside the servers' tests (tests/run.sh).
pytestmark = pytest.mark.beside_servers
KEY = "right-key-0123456789"


# Run in a child: importing vLLM reconfigures logging. Builds vLLM's app from the gateway's own command line and
# environment (no engine, no server), then sends every route, with each of its methods, without the key, with a
# wrong one and with the right one.
VLLM_APP_PROBE = """
import json, os, sys
from starlette.testclient import TestClient
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.app import build_app

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
app = build_app(args, ("generate",), None)
client = TestClient(app, raise_server_exceptions=False)
out = []
for route in app.routes:
    for method in sorted(getattr(route, "methods", None) or ["GET"]):
        path = route.path.replace("{", "").replace("}", "")
        codes = [
            client.request(method, path, json={}, headers=h).status_code
            for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + os.environ["VLLM_API_KEY"]})
        ]
        out.append([method, route.path, *codes])
print("ROUTES " + json.dumps({"middleware": args.middleware, "routes": out}))
"""


@pytest.mark.slow  # imports vLLM (~20 s)
def test_vllms_own_app_refuses_every_route_without_the_key():
    pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
    argv, env = build_vllm_command(GatewayConfig(model="m"), "/models/m", 8123, KEY, serve_cli=False)
    vllm_args = argv[argv.index("--model") :]
    done = subprocess.run(
        [sys.executable, "-c", VLLM_APP_PROBE, *vllm_args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("ROUTES ")), None)
    assert line is not None, done.stderr[-3000:]
    found = json.loads(line.removeprefix("ROUTES "))
    assert found["middleware"] == [VLLM_GUARD_MIDDLEWARE]
    routes = {(m, p): codes for m, p, *codes in found["routes"]}
    # The routes that answered anyone before the guard: vLLM checked its key only under /v1, /v2, ...
    for must in [("POST", "/adapters"), ("DELETE", "/adapters/{adapter_name}"), ("POST", "/invocations")]:
        assert must in routes, sorted(routes)
    open_ = {k: v for k, v in routes.items() if v[0] != 401 or v[1] != 401}
    assert not open_, f"answered without the key: {open_}"
    # With the key the request reaches vLLM's handlers (which fail here: no engine), so the guard let it through.
    assert all(v[2] != 401 for v in routes.values()), routes
    print(f"{len(routes)} (method, route) pairs refused without the key")
