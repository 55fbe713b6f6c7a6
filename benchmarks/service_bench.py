"""`python -m benchmarks service`: the Tinker-protocol service under 1, 2 and 4 concurrent SDK clients, on the
config given (default: the tiny CPU model), through `bash launch.sh service` (gateway and vLLM included).

Per client count: training tokens/s (each client runs `--rounds` of forward_backward(importance_sampling) +
optim_step on its own batch, all clients at once) and sampled tokens/s (each client samples `--prompts` prompts x
`--samples` completions of `--max-tokens` from its own snapshot, all at once). Per-call overhead: the SDK's round
trip of one forward_backward against the seconds the same call spent in the training backend inside the service
(its metrics.jsonl row), one client alone. Prefill: one RL step's sampling (`--prompts` fresh prompts of
`--prompt-tokens` x `--samples`), once as the cookbook samples (one call per prompt, num_samples=N) and once as N
calls of one sample each; for each, the prompt tokens vLLM received against those it computed (its own /metrics
counters: vLLM shares a prompt's cached KV blocks between the samples, a partial last block excepted).
Prints one JSON. Must not be a test: timings are the machine's.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.orchestration.commands import ROOT, git_sha
from trainer.orchestration.processes import stop_child

COMMAND = "python -m benchmarks service"  # the command line the JSON records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    p.add_argument("--clients", default="1,2,4", help="concurrent training clients to measure")
    p.add_argument("--rounds", type=int, default=5, help="forward_backward + optim_step per client")
    p.add_argument("--datums", type=int, default=16, help="datums per forward_backward")
    p.add_argument("--tokens", type=int, default=128, help="tokens per datum")
    p.add_argument("--prompts", type=int, default=8, help="sample calls per client")
    p.add_argument("--samples", type=int, default=8, help="num_samples per call")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per sample (stop=[]: exactly this)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per client count (medians reported)")
    p.add_argument(
        "--prompt-tokens", type=int, default=200, help="tokens per prompt in the prefill measurement"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides for the service's run config")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "trainer.orchestration.service_launch", "--config", args.config]
    argv += ["service.port=0", f"service.output_dir={out}", "service.max_clients=64"]
    # vLLM on a known port and key, so that the prefill measurement can read its /metrics
    argv += [
        f"inference.vllm.port={args.vllm_port}",
        f"inference.vllm.api_key={args.vllm_key}",
        *args.overrides,
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=(out / "launch.log").open("w"), text=True
    )
    assert proc.stdout is not None
    line = ""
    while not line.startswith("listening on "):
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the service did not start; read {out / 'launch.log'}")
    return proc, line.split()[-1]


def batch(types: Any, args: argparse.Namespace, vocab: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    datums = []
    for _ in range(args.datums):
        tokens = [rng.randrange(3, vocab) for _ in range(args.tokens + 1)]
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [-7.0] * args.tokens,
                    "advantages": [rng.uniform(-1, 1)] * args.tokens,
                },
            )
        )
    return datums


def measure(tinker: Any, url: str, args: argparse.Namespace, n: int) -> dict[str, Any]:
    types = tinker.types
    sc = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    clients = [
        sc.create_lora_training_client(base_model=args.base, rank=8, seed=i).result() for i in range(n)
    ]
    batches = [batch(types, args, args.vocab, i) for i in range(n)]

    def train(i: int) -> None:
        for _ in range(args.rounds):
            clients[i].forward_backward(batches[i], "importance_sampling")
            clients[i].optim_step(types.AdamParams(learning_rate=1e-4)).result()

    samplers = [c.save_weights_and_get_sampling_client().result() for c in clients]
    params = types.SamplingParams(max_tokens=args.max_tokens, stop=[])
    for s in samplers:  # the first sample of each loads its adapter into vLLM: not what is measured
        s.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params).result()

    def sample(i: int) -> int:
        futures = [
            samplers[i].sample(types.ModelInput.from_ints([5, 6, 7 + p]), args.samples, params)
            for p in range(args.prompts)
        ]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    train_s, sample_s, sampled = [], [], 0
    with ThreadPoolExecutor(n) as pool:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            list(pool.map(train, range(n)))
            train_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sampled = sum(pool.map(sample, range(n)))
            sample_s.append(time.perf_counter() - t0)
    trained = n * args.rounds * args.datums * args.tokens
    return {
        "clients": n,
        "training_tokens": trained,
        "training_s_median": round(statistics.median(train_s), 3),
        "training_tokens_per_s": round(trained / statistics.median(train_s), 1),
        "sampled_tokens": sampled,
        "sampling_s_median": round(statistics.median(sample_s), 3),
        "sampled_tokens_per_s": round(sampled / statistics.median(sample_s), 1),
    }


def overhead(tinker: Any, url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One client alone: the SDK's forward_backward round trip against the backend's own seconds for it."""
    types = tinker.types
    tc = (
        tinker.ServiceClient(base_url=url, api_key="tml-bench")
        .create_lora_training_client(base_model=args.base, rank=8, seed=99)
        .result()
    )
    datums = batch(types, args, args.vocab, 99)
    walls = []
    for _ in range(args.rounds + 1):
        t0 = time.perf_counter()
        tc.forward_backward(datums, "importance_sampling").result()
        walls.append(time.perf_counter() - t0)
    rows = [json.loads(line) for f in out.glob("*/metrics.jsonl") for line in f.read_text().splitlines()]
    mine = [
        r["seconds"] for r in rows if r.get("model_id") == tc.model_id and r["call"] == "forward_backward"
    ]
    sdk, backend = statistics.median(walls[1:]), statistics.median(mine[1:])
    return {
        "forward_backward_sdk_s_median": round(sdk, 4),
        "forward_backward_backend_s_median": round(backend, 4),
        "per_call_overhead_s": round(sdk - backend, 4),
        "overhead_ratio": round(sdk / backend, 3),
    }


PREFILL_COUNTERS = {
    "received": "vllm:prompt_tokens_total",
    "computed": "vllm:request_prefill_kv_computed_tokens_sum",
}


def vllm_counters(args: argparse.Namespace) -> dict[str, float]:
    """vLLM's prompt-token counters, summed over their label sets."""
    import httpx

    r = httpx.get(
        f"http://127.0.0.1:{args.vllm_port}/metrics",
        headers={"Authorization": f"Bearer {args.vllm_key}"},
        timeout=30,
    )
    r.raise_for_status()
    totals = dict.fromkeys(PREFILL_COUNTERS, 0.0)
    for line in r.text.splitlines():
        for key, name in PREFILL_COUNTERS.items():
            if line.startswith((name + "{", name + " ")):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def prefill(tinker: Any, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One RL step's sampling, P fresh prompts x N samples, in the two ways a client may ask for it."""
    types = tinker.types
    tc = (
        tinker.ServiceClient(base_url=url, api_key="tml-bench")
        .create_lora_training_client(base_model=args.base, rank=8, seed=7)
        .result()
    )
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=args.max_tokens, stop=[])
    sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params).result()  # loads the adapter
    rng = random.Random(1234)
    P, N, L = args.prompts, args.samples, args.prompt_tokens
    styles: dict[str, Any] = {}
    for style, calls_per_prompt, n in (("one_call_per_prompt", 1, N), ("one_call_per_sample", N, 1)):
        prompts = [[rng.randrange(3, args.vocab) for _ in range(L)] for _ in range(P)]
        before = vllm_counters(args)
        t0 = time.perf_counter()
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), n, params)
            for p in prompts
            for _ in range(calls_per_prompt)
        ]
        sampled = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        seconds = time.perf_counter() - t0
        after = vllm_counters(args)
        computed = after["computed"] - before["computed"]
        styles[style] = {
            "prompt_tokens_received": after["received"] - before["received"],
            "prefill_tokens_computed": computed,
            "computed_in_prompts_worth": round(computed / (P * L), 3),
            "sampled_tokens_per_s": round(sampled / seconds, 1),
        }
    return {"prompts": P, "samples": N, "prompt_tokens": L, "one_prefill_per_prompt": P * L, **styles}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.vllm_port, args.vllm_key = free_port(), secrets.token_urlsafe(32)
    import tinker

    out = Path(tempfile.mkdtemp(prefix="service-bench-"))
    proc, url = start(args, out)
    try:
        import httpx

        args.base = httpx.get(f"{url}/health").json()["model"]
        tc = (
            tinker.ServiceClient(base_url=url, api_key="tml-bench")
            .create_lora_training_client(base_model=args.base, rank=8)
            .result()
        )
        args.vocab = min(len(tc.get_tokenizer()), 2**15)
        results = [measure(tinker, url, args, int(n)) for n in args.clients.split(",")]
        cost = overhead(tinker, url, args, out)
        prefill_step = prefill(tinker, url, args)
    finally:
        stop_child(proc, 60)
    print(
        json.dumps(
            {
                "command": COMMAND + " " + " ".join(argv if argv is not None else sys.argv[1:]),
                "git": git_sha(),
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "config": args.config,
                "per_client_count": results,
                "repeats": args.repeats,
                "overhead": cost,
                "prefill": prefill_step,
                "output_dir": str(out),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
