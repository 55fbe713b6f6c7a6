"""The gateway's HTTP client to vLLM at a run's concurrency: CPU per request of httpx (httpcore 1.0) against httpx2,
with the gateway's pool limits, against a stand-in server in its own process (uvicorn, a fixed JSON answer).

    python -m benchmarks client_pool [--concurrency 64 128] [--rounds 20]

Each round sends `concurrency` POSTs at once through one AsyncClient (the pool warmed by one round first), as a
step's rollouts reach the gateway. Prints one JSON object: the client process's CPU milliseconds per request and
the wall time, for each library and concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import subprocess
import sys
import time
from typing import Any

from trainer.orchestration.commands import ROOT, git_sha
from trainer.orchestration.processes import die_with_parent
from trainer.training.polling import wait_until

ANSWER = json.dumps({"token_ids": [list(range(16))], "logprobs": [[-0.5] * 16]}).encode()
LIMITS = {"max_connections": 1024, "max_keepalive_connections": 256}  # inference/samplers/vllm.py's


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The stand-in vLLM: reads the body, answers one fixed completion."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


async def measure(lib: str, url: str, concurrency: int, rounds: int) -> dict[str, Any]:
    http = __import__(lib)
    async with http.AsyncClient(base_url=url, limits=http.Limits(**LIMITS)) as client:

        async def one(i: int) -> None:
            await asyncio.sleep(0.001 * (i % 7))  # arrivals spread over a few ms, as environments send them
            (await client.post("/v1/completions", json={"prompt": [i], "max_tokens": 16})).raise_for_status()

        async def one_round() -> None:
            await asyncio.gather(*(one(i) for i in range(concurrency)))

        await one_round()
        cpu, wall = time.process_time(), time.monotonic()
        for _ in range(rounds):
            await one_round()
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    n = rounds * concurrency
    return {
        "lib": lib,
        "concurrency": concurrency,
        "requests": n,
        "cpu_ms_per_request": 1000 * cpu / n,
        "wall_s": wall,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks client_pool", description=__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 128])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    port = free_port()
    argv_server = [sys.executable, "-m", "uvicorn", "benchmarks.client_pool_bench:app", "--port", str(port)]
    server = subprocess.Popen(
        [*argv_server, "--log-level", "warning", "--no-access-log"],
        cwd=ROOT,
        preexec_fn=die_with_parent,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(port), 30, "the stand-in server", 0.2)
        rows = [
            asyncio.run(measure(lib, url, c, args.rounds))
            for c in args.concurrency
            for lib in ("httpx", "httpx2")
        ]
    finally:
        server.terminate()
        server.wait(timeout=30)
    command = "python -m benchmarks client_pool " + " ".join(argv if argv is not None else sys.argv[1:])
    out = {"command": command.strip(), "git": git_sha(), "machine": platform.machine(), "limits": LIMITS}
    print(
        json.dumps(
            {
                **out,
                "rows": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
            }
        )
    )
    return 0


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
