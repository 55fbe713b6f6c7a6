"""Gateway benchmark on the tiny model: publish latency versus a vLLM cold restart, and gateway overhead.

    python -m benchmarks gateway [--publishes 20] [--restarts 2] [--rounds 20] [--n 16] [--max-tokens 64]

- publish latency: adapter folder written (trainer's save_for_sampler returns) -> first /generate answered by
  that version (header X-Policy-Version), p50/p95 over --publishes versions;
- cold restart: a fresh vLLM process (same command line) from spawn to its first completion under the adapter,
  which is what a restart-per-update trainer pays each step;
- short calls: added latency of the gateway on /health and one-token /generate over kept-alive connections,
  against vLLM's own /health and one-token completion (--short-rounds each, interleaved);
- overhead: the same /generate load (n, max_tokens, ignore_eos so every request does identical work) sent
  through the gateway and directly to its vLLM (/v1/completions), interleaved; medians and ratio.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from trainer.orchestration.commands import ROOT, git_sha
from trainer.orchestration.gateway_process import spawn_gateway
from trainer.orchestration.processes import die_with_parent
from trainer.training.gateway_client import GatewayClient
from trainer.training.polling import wait_until

COMMAND = "python -m benchmarks gateway"  # the command line the JSON records


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


def measure_publishes(url: str, count: int, out_dir: Path) -> list[dict[str, float]]:
    from trainer.backends.local import LocalBackend
    from trainer.training.batch import TrainingExample
    from trainer.training.config import RunConfig, load_config
    from trainer.training.loss_params import LossParams
    from trainer.training.schedule import adam_params

    cfg = load_config(RunConfig, ROOT / "configs" / "tiny_cpu.yaml", [f"trainer.output_dir={out_dir}"])
    backend = LocalBackend(cfg)
    example = TrainingExample(
        input_ids=list(range(5, 37)),
        target_ids=list(range(6, 38)),
        loss_mask=[0.0] * 8 + [1.0] * 24,
        sampler_logprobs=[0.0] * 8 + [-7.6] * 24,
        advantages=[0.0] * 8 + [1.0] * 24,
    )
    client = GatewayClient(url)
    http = httpx.Client(base_url=url, timeout=120)
    rows = []
    for version in range(1, count + 1):
        backend.forward_backward([example], LossParams("importance_sampling"))
        backend.optim_step(adam_params(1e-3))
        path = backend.save_for_sampler(version)
        written = time.perf_counter()
        client.publish(version, path)
        published = time.perf_counter()
        r = http.post("/generate", json={"prompt": {"prompt_token_ids": [5, 6, 7]}, "max_tokens": 1})
        served = time.perf_counter()
        assert r.headers["x-policy-version"] == str(version), r.headers
        rows.append(
            {
                "publish_s": published - written,
                "first_completion_s": served - published,
                "latency_s": served - written,
            }
        )
    client.close()
    http.close()
    return rows


def vllm_command(gateway_yaml: Path) -> tuple[list[str], dict[str, str]]:
    """The exact vLLM command the gateway starts for this config (asked of the gateway's own code)."""
    out = subprocess.run(
        [sys.executable, "-m", "inference", "--config", str(gateway_yaml), "--vllm-command"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    spec = json.loads(out)
    return spec["argv"], spec["env"]


def measure_cold_restart(gateway_yaml: Path, adapter: str, log: Path) -> float:
    """Spawn to the first completion under `adapter`: what a trainer that restarts vLLM per update pays."""
    argv, extra_env = vllm_command(gateway_yaml)
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    served_name = argv[argv.index("--served-model-name") + 1]
    started = time.perf_counter()
    with log.open("ab") as logf:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **extra_env},
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,  # gone with the benchmark, even if it is killed
        )
    try:
        auth = {"Authorization": f"Bearer {extra_env['VLLM_API_KEY']}"}
        with httpx.Client(base_url=url, timeout=60, headers=auth) as http:

            def completes() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited; read {log}")
                with contextlib.suppress(httpx.HTTPError):
                    body = {"model": served_name, "prompt": [5], "max_tokens": 1}
                    return http.post("/v1/completions", json=body).status_code == 200
                return False

            wait_until(completes, 600, "cold vLLM answering", 0.2)
            http.post(
                "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter}
            ).raise_for_status()
            http.post(
                "/v1/completions", json={"model": "a", "prompt": [5], "max_tokens": 1}
            ).raise_for_status()
        return time.perf_counter() - started
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


async def measure_overhead(
    vllm_key: str, url: str, vllm_url: str, model_name: str, rounds: int, n: int, max_tokens: int
) -> dict[str, Any]:
    prompt = list(range(5, 69))
    sampling = {"n": n, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    gw_body = {"prompt": {"prompt_token_ids": prompt}, "logprobs": 0, **sampling}
    direct_body = {
        "model": model_name,
        "prompt": prompt,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        **sampling,
    }
    times: dict[str, list[float]] = {"gateway": [], "direct": []}
    async with httpx.AsyncClient(timeout=300) as http:
        direct_auth = {"Authorization": f"Bearer {vllm_key}"}

        async def one(kind: str) -> None:
            t0 = time.perf_counter()
            if kind == "gateway":
                r = await http.post(f"{url}/generate", json=gw_body)
            else:
                r = await http.post(f"{vllm_url}/v1/completions", json=direct_body, headers=direct_auth)
            r.raise_for_status()
            times[kind].append(time.perf_counter() - t0)

        await one("gateway")  # warm-up
        await one("direct")
        times = {"gateway": [], "direct": []}
        for i in range(rounds):
            order = ("gateway", "direct") if i % 2 == 0 else ("direct", "gateway")
            for kind in order:
                await one(kind)
    gw, direct = statistics.median(times["gateway"]), statistics.median(times["direct"])
    return {
        "requests_per_path": rounds,
        "n": n,
        "max_tokens": max_tokens,
        "gateway_median_s": gw,
        "direct_median_s": direct,
        "overhead_ratio": gw / direct - 1.0,
        "gateway_p95_s": percentile(times["gateway"], 0.95),
        "direct_p95_s": percentile(times["direct"], 0.95),
    }


async def measure_short_calls(
    vllm_key: str, url: str, vllm_url: str, model_name: str, rounds: int
) -> dict[str, Any]:
    """Added latency on short calls over one kept-alive connection per side (what Atropos clients hold): /health,
    and a one-token /generate against vLLM's one-token completion. Interleaved; medians in ms, and their gaps."""
    prompt = list(range(5, 13))
    one_token = {"max_tokens": 1, "temperature": 0.0, "n": 1}
    calls = {
        "health": (("GET", f"{url}/health", None), ("GET", f"{vllm_url}/health", None)),
        "generate_1_token": (
            ("POST", f"{url}/generate", {"prompt": {"prompt_token_ids": prompt}, "logprobs": 0, **one_token}),
            (
                "POST",
                f"{vllm_url}/v1/completions",
                {
                    "model": model_name,
                    "prompt": prompt,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                    **one_token,
                },
            ),
        ),
    }
    result: dict[str, Any] = {"rounds": rounds}
    async with (
        httpx.AsyncClient(timeout=60) as gw_http,
        httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {vllm_key}"}) as vllm_http,
    ):
        for name, (gw_call, direct_call) in calls.items():
            times: dict[str, list[float]] = {"gateway": [], "direct": []}
            for i in range(rounds + 2):  # the first two rounds warm both connections
                order = (("gateway", gw_http, gw_call), ("direct", vllm_http, direct_call))
                for kind, http, (method, target, body) in order if i % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    r = await http.request(method, target, json=body)
                    r.raise_for_status()
                    if i >= 2:
                        times[kind].append(time.perf_counter() - t0)
            gw, direct = statistics.median(times["gateway"]), statistics.median(times["direct"])
            result[name] = {
                "gateway_median_ms": gw * 1e3,
                "direct_median_ms": direct * 1e3,
                "added_ms": (gw - direct) * 1e3,
                "gateway_p95_ms": percentile(times["gateway"], 0.95) * 1e3,
            }
    return result


async def measure_throughput(
    url: str, requests: int, concurrency: int, n: int, max_tokens: int
) -> dict[str, Any]:
    """Sampled tokens per second through the gateway with `concurrency` requests in flight."""
    body = {
        "prompt": {"prompt_token_ids": list(range(5, 69))},
        "logprobs": 0,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one() -> int:
            async with sem:
                r = await http.post(f"{url}/generate", json=body)
                r.raise_for_status()
                return sum(len(ids) for ids in r.json()["token_ids"])

        await one()  # warm-up
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one() for _ in range(requests))))
        elapsed = time.perf_counter() - t0
    return {
        "requests": requests,
        "concurrency": concurrency,
        "sampled_tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--publishes", type=int, default=20)
    p.add_argument("--restarts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas behind the gateway")
    p.add_argument("overrides", nargs="*", help="run config overrides, e.g. inference.vllm.replica_env=...")
    p.add_argument(
        "--short-rounds", type=int, default=200, help="kept-alive /health and 1-token calls per path"
    )
    p.add_argument("--throughput-requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    return p.parse_args(argv)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every measurement against one gateway on the tiny model (and cold vLLM starts beside it)."""
    config = str(ROOT / "configs" / "tiny_cpu.yaml")
    vllm_key = secrets.token_urlsafe(32)  # the bench also calls vLLM directly, to compare
    overrides = [
        f"inference.vllm.replicas={args.replicas}",
        f"inference.vllm.api_key={vllm_key}",
        *args.overrides,
    ]
    with spawn_gateway(config, overrides, work / "logs", timeout_s=600) as (url, _):
        rows = measure_publishes(url, args.publishes, work / "run")
        client = GatewayClient(url)
        status = client.status()
        client.close()
        assert status.backend_url is not None
        first_replica = status.backend_url.split(",")[0]  # direct calls go to one replica, like the gateway's
        current = f"policy-v{status.current_version}"
        overhead = asyncio.run(
            measure_overhead(vllm_key, url, first_replica, current, args.rounds, args.n, args.max_tokens)
        )
        short = asyncio.run(measure_short_calls(vllm_key, url, first_replica, current, args.short_rounds))
        throughput = asyncio.run(
            measure_throughput(url, args.throughput_requests, args.concurrency, args.n, args.max_tokens)
        )
        last_adapter = str(work / "run" / "adapters" / f"v{args.publishes:06d}")
        cold_log = work / "logs" / "cold.log"
        gateway_yaml = work / "logs" / "gateway.yaml"
        restarts = [measure_cold_restart(gateway_yaml, last_adapter, cold_log) for _ in range(args.restarts)]
    return {
        "rows": rows,
        "overhead": overhead,
        "short_calls": short,
        "throughput": throughput,
        "restarts": restarts,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    m = measure(args, Path(tempfile.mkdtemp(prefix="gateway-bench-")))
    rows, restarts = m["rows"], m["restarts"]
    latency = [r["latency_s"] for r in rows]
    result = {
        "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "git_sha": git_sha(),
        "hardware": {"cpu": platform.machine(), "cores": os.cpu_count()},
        "publish": {
            "count": len(rows),
            "latency_p50_s": statistics.median(latency),
            "latency_p95_s": percentile(latency, 0.95),
            "publish_call_p50_s": statistics.median(r["publish_s"] for r in rows),
            "first_completion_p50_s": statistics.median(r["first_completion_s"] for r in rows),
        },
        "cold_restart_s": restarts,
        "replicas": args.replicas,
        "cold_restart_median_s": statistics.median(restarts) if restarts else None,
        "restart_over_publish_ratio": statistics.median(restarts) / statistics.median(latency)
        if restarts
        else None,
        "overhead": m["overhead"],
        "short_calls": m["short_calls"],
        "throughput": m["throughput"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
