"""The same step on both backends: `--backend local` and `--backend tinker` (the unmodified tinker SDK against this
project's Tinker-protocol service, in this process) take one batch of the tiny model in float32 and must agree on
the loss and on the adapter after the optimizer step. That holds only if the two train the same adapter (modules,
rank, scaling, initialisation) with the same loss math and the same Adam; it is what makes a comparison run compare
the backends and nothing else."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers import FIXTURE, make_cfg, training_service
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.config import ConfigError, RunConfig
from trainer.training.loss_params import LossParams
from trainer.training.schedule import adam_params

tinker = pytest.importorskip("tinker")

ADAPTER_NAME = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")


def lora_weights(named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """LoRA tensors by module path, the adapter's own name taken out (PEFT's 'default' here, the model id there)."""
    return {
        ADAPTER_NAME.sub(r".lora_\1.weight", name).removeprefix("base_model.model."): p.detach().clone()
        for name, p in named
        if ".lora_" in name
    }


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[tuple[str, Any]]:
    with training_service(tmp_path_factory.mktemp("service")) as served:
        yield served


def served_weights(state: Any, remote: Any) -> dict[str, torch.Tensor]:
    """The service's LoRA tensors of the training client `remote` trains."""
    name = state.models[remote.client.model_id]
    return lora_weights((n, p) for n, p in state.policies.peft.named_parameters() if f".{name}." in n)


def backends(tmp_path: Any, url: str, **over: Any) -> tuple[Any, Any, RunConfig]:
    from trainer.backends.local import LocalBackend
    from trainer.backends.tinker import TinkerBackend

    cfg = make_cfg(tmp_path, **over)
    remote = TinkerBackend(cfg, service=tinker.ServiceClient(base_url=url, api_key="tml-local-test"))
    return LocalBackend(cfg), remote, cfg


@pytest.mark.parametrize(
    ("loss", "reduction"),
    [("importance_sampling", "token_mean"), ("ppo", "seq_mean_token_sum"), ("cross_entropy", "sum")],
)
def test_one_step_on_one_batch_is_the_same_update_on_both_backends(tmp_path, service, loss, reduction):
    url, state = service
    local, remote, _ = backends(tmp_path, url)
    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples[:6]
    params = LossParams(loss)
    before = lora_weights(local.model.named_parameters())
    served = served_weights(state, remote)
    assert served.keys() == before.keys(), "the same modules, at the same rank"
    for name, tensor in before.items():
        assert torch.equal(served[name], tensor), f"{name}: another initialisation"

    mine = local.forward_backward(examples, params, reduction)
    theirs = remote.forward_backward(examples, params, reduction)
    assert theirs.loss == pytest.approx(mine.loss, rel=1e-5, abs=1e-6)
    for a, b in zip(mine.trainer_logprobs, theirs.trainer_logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)

    adam = adam_params(1e-2, weight_decay=0.01)  # decay too: both backends must apply it alike
    local.optim_step(adam)
    remote.optim_step(adam)
    after_local = lora_weights(local.model.named_parameters())
    after_remote = served_weights(state, remote)
    moved = 0
    for name, tensor in after_local.items():
        delta = (tensor - before[name]).norm()
        moved += int(delta > 0)
        scale = max(float(tensor.norm()), 1e-12)
        assert float((after_remote[name] - tensor).norm()) / scale < 1e-5, name
    assert moved == len(after_local), (
        "the step moved every LoRA tensor (B by its gradient, A by weight decay)"
    )


def test_a_lora_tinker_cannot_express_is_refused_before_anything_trains(tmp_path, service):
    url, _ = service
    with pytest.raises(ConfigError, match=r"Tinker trains q_proj, k_proj, v_proj, o_proj together"):
        backends(tmp_path, url, lora__target_modules=["q_proj", "v_proj"])
