"""The local Tinker-protocol service driven by the unmodified tinker SDK, on the tiny model: its training half, with
`python -m trainer.service` alone (no gateway, so sampling is refused). One real service process for the module;
tests/integration/test_service_sampling.py covers sampling through `bash launch.sh service`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.helpers import ROOT
from trainer.orchestration.processes import stop_child
from trainer.training.polling import wait_until

tinker = pytest.importorskip("tinker")
types = tinker.types


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    out = tmp_path_factory.mktemp("service")
    log = (out / "service.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.service",
            "--config",
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            "service.port=0",
            f"service.output_dir={out}",
            "service.max_clients=64",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), (line, (out / "service.log").read_text())
        url = line.split()[-1]
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "the service healthy", 0.2)
        yield url, out
    finally:
        stop_child(proc, 10)


def client(url: str) -> Any:
    return tinker.ServiceClient(base_url=url, api_key="tml-local-test")


def datum(tokens: list[int], advantage: float, sampler_lp: float = -2.0) -> Any:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [sampler_lp] * n,
            "advantages": [0.0] * 2 + [advantage] * (n - 2),
        },
    )


BATCH = [datum([5, 17, 23, 42, 42, 7, 9], 1.0), datum([5, 17, 23, 11, 12, 13, 14], -1.0)]


def state_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {f"w/{k}": v for k, v in load_file(folder / "adapter.safetensors").items()}
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    for index, slots in optimizer["state"].items():
        for key, value in slots.items():
            out[f"adam/{index}/{key}"] = torch.as_tensor(value)
    return out


def folder_of(out: Path, path: str) -> Path:
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    return out / model_id.replace(":", "_") / kind / name


def test_three_clients_on_one_base_stay_isolated(service):
    url, out = service
    sc = client(url)
    clients = [
        sc.create_lora_training_client(base_model="tiny", rank=r, seed=s).result()
        for r, s in ((8, 1), (4, 2), (8, 3))
    ]
    assert len({c.model_id for c in clients}) == 3 and clients[1].get_info().lora_rank == 4
    assert clients[0].get_tokenizer() is not None  # from the local model folder: no hub
    before = [folder_of(out, c.save_state("before").result().path) for c in clients]
    # One step on the first client only, forward_backward and optim_step submitted before either is awaited.
    fb = clients[0].forward_backward(BATCH, "importance_sampling")
    step = clients[0].optim_step(types.AdamParams(learning_rate=1e-2))
    result = fb.result()
    assert step.result() is not None
    assert [len(o["logprobs"].tolist()) for o in result.loss_fn_outputs] == [6, 6]
    assert result.metrics["loss:sum"] != 0.0
    after = [folder_of(out, c.save_state("after").result().path) for c in clients]
    moved = state_of(after[0])
    assert any(not torch.equal(v, state_of(before[0])[k]) for k, v in moved.items() if k.startswith("w/"))
    for b, a in zip(before[1:], after[1:]):
        s_before, s_after = state_of(b), state_of(a)
        assert s_before.keys() == s_after.keys()
        assert all(torch.equal(s_before[k], s_after[k]) for k in s_before), "another client's step touched it"
    rows = (out / clients[0].model_id.replace(":", "_") / "metrics.jsonl").read_text().splitlines()
    assert any('"call": "forward_backward"' in r for r in rows) and any(
        '"call": "optim_step"' in r for r in rows
    )


def test_custom_loss_written_as_the_is_formula_gives_the_builtin_gradients(service):
    url, out = service
    sc = client(url)
    builtin, custom = (
        sc.create_lora_training_client(base_model="tiny", rank=8, seed=7).result() for _ in range(2)
    )

    def is_loss(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.zeros(())
        for d, lp in zip(data, logprobs):
            sampler = torch.tensor(d.loss_fn_inputs["logprobs"].tolist())
            advantages = torch.tensor(d.loss_fn_inputs["advantages"].tolist())
            total = total - (torch.exp(lp - sampler) * advantages).sum()
        return total, {}

    expected = builtin.forward_backward(BATCH, "importance_sampling").result().metrics["loss:sum"]
    got = custom.forward_backward_custom(BATCH, is_loss).result().metrics["loss:sum"]
    assert got == pytest.approx(expected, rel=1e-5)
    # An Adam step with a huge eps moves each weight by lr * g / eps: the gradients themselves, compared.
    adam = types.AdamParams(learning_rate=1.0, eps=1e3)
    builtin.optim_step(adam).result()
    custom.optim_step(adam).result()
    a = state_of(folder_of(out, builtin.save_state("one").result().path))
    b = state_of(folder_of(out, custom.save_state("one").result().path))
    for key in (k for k in a if k.startswith("w/")):
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-9)


def test_save_and_load_state_round_trip_exactly(service):
    url, out = service
    sc = client(url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()
    for _ in range(2):
        tc.forward_backward(BATCH, "ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5})
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
    saved_path = tc.save_state("two").result().path
    saved = state_of(folder_of(out, saved_path))
    tc.forward_backward(BATCH, "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.load_state_with_optimizer(saved_path).result()
    again = state_of(folder_of(out, tc.save_state("reloaded").result().path))
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    tc.load_state(saved_path).result()  # weights only: Adam starts again
    fresh = state_of(folder_of(out, tc.save_state("weights-only").result().path))
    assert not any(k.startswith("adam/") for k in fresh)
    assert all(torch.equal(saved[k], fresh[k]) for k in fresh)
    other = sc.create_training_client_from_state_with_optimizer(saved_path).result()
    copied = state_of(folder_of(out, other.save_state("copy").result().path))
    assert all(torch.equal(saved[k], copied[k]) for k in saved)


@pytest.mark.parametrize(
    "loss", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "grpo", "gspo"]
)
def test_every_loss_runs_through_the_sdk(service, loss):
    url, _ = service
    tc = client(url).create_lora_training_client(base_model="tiny", rank=4).result()
    data = BATCH
    if loss == "gspo":  # the sampled tokens make each sequence's ratio
        data = [
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={**d.loss_fn_inputs, "sequence_ratio_mask": [0.0] * 2 + [1.0] * 4},
            )
            for d in BATCH
        ]
    if loss == "cross_entropy":
        data = [
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": [0.5] * 6},
            )
            for d in BATCH
        ]
    out = tc.forward_backward(data, loss).result()
    assert torch.isfinite(torch.tensor(out.metrics["loss:sum"]))
    if loss == "cross_entropy":  # -sum(weights * logprobs)
        lps = sum(sum(o["logprobs"].tolist()) for o in out.loss_fn_outputs)
        assert out.metrics["loss:sum"] == pytest.approx(-0.5 * lps, rel=1e-5)


def test_refusals_reach_the_sdk_as_errors_and_the_client_goes_on(service):
    url, _ = service
    tc = client(url).create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="'stable_reinforce' needs provenance"):
        tc.forward_backward(BATCH, "stable_reinforce").result()
    bad_shape = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]}
    )
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].*shape \[2\].*3 tokens"):
        tc.forward_backward([bad_shape], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs\\['advantages'\\]"):
        tc.forward_backward(
            [types.Datum(model_input=bad_shape.model_input, loss_fn_inputs={"target_tokens": [2, 3, 4]})],
            "ppo",
        ).result()
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        tc.forward_backward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2, 10**7]},
                )
            ],
            "cross_entropy",
        ).result()
    with pytest.raises(tinker.RequestFailedError, match="sampling needs the gateway"):
        tc.save_weights_and_get_sampling_client().result()
    assert tc.forward_backward(BATCH, "importance_sampling").result().metrics["loss:sum"] != 0.0
    with pytest.raises(tinker.RequestFailedError, match="trains 'tiny'"):
        client(url).create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()


def test_closing_a_session_releases_its_clients(service):
    url, _ = service
    sc = client(url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.forward_backward(BATCH, "importance_sampling").result()

    def clients() -> int:
        return int(httpx.get(f"{url}/health").json()["clients"])

    before = clients()
    sc.close("success")
    wait_until(lambda: clients() == before - 1, 30, "the closed session's client released", 0.1)
    again = client(url).create_lora_training_client(base_model="tiny", rank=4).result()
    assert again.forward_backward(BATCH, "importance_sampling").result().metrics["loss:sum"] != 0.0


def test_sampler_weights_pass_the_gateways_adapter_check(service, tiny_model_path):
    """save_weights_for_sampler writes a PEFT folder that the gateway's pre-load check (what runs before vLLM loads
    an adapter) accepts, lm_head included."""
    from inference.policy.adapters import base_linear_shapes, validate_adapter

    url, out = service
    tc = client(url).create_lora_training_client(base_model="tiny", rank=8).result()
    tc.forward_backward(BATCH, "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    folder = folder_of(out, tc.save_weights_for_sampler("s1").result().path)
    assert (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    validate_adapter(str(folder), base_linear_shapes(str(tiny_model_path)), max_rank=8, max_abs=1e3)
    with pytest.raises(tinker.RequestFailedError, match="exist already"):
        tc.save_weights_for_sampler("s1").result()


def test_loss_and_gradients_match_a_float64_reference(service, tiny_model_path):
    """The SDK's forward_backward(importance_sampling) on a generic adapter (A and B random, lm_head included): the
    logprobs, the summed loss and the gradient (its norm, and its sign in every element through the first AdamW
    step, which moves each weight by lr * g/(|g| + eps)) against float64 transformers + PEFT computed here."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from trainer.service.policies import ADAPTER_KEY, LoraSpec

    url, out = service
    sc = client(url)
    start = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    path = start.save_state("generic").result().path
    folder = folder_of(out, path)
    gen = torch.Generator().manual_seed(0)
    weights = {
        k: torch.randn(v.shape, generator=gen) * 0.05
        for k, v in load_file(folder / "adapter.safetensors").items()
    }
    save_file(weights, folder / "adapter.safetensors")
    tc = sc.create_training_client_from_state(path).result()  # these weights, a fresh AdamW
    answer = tc.forward_backward(BATCH, "importance_sampling").result()
    lr = 1e-3
    grad_norm = tc.optim_step(types.AdamParams(learning_rate=lr)).result().metrics["grad_norm"]
    after = load_file(folder_of(out, tc.save_state("generic-after").result().path) / "adapter.safetensors")

    spec = LoraSpec(**json.loads((folder / "state.json").read_text())["spec"])
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    ref = get_peft_model(
        ref,
        LoraConfig(
            r=spec.rank, lora_alpha=32, target_modules=spec.targets(), bias="none", task_type="CAUSAL_LM"
        ),
    )
    named = dict(ref.named_parameters())
    params = {k: named[k.replace(f".{ADAPTER_KEY}.", ".default.")] for k in weights}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(weights[k].double())
    loss = torch.zeros((), dtype=torch.float64)
    for i, datum in enumerate(BATCH):
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
        lp = ref(input_ids=ids).logits[0].log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        served = torch.tensor(answer.loss_fn_outputs[i]["logprobs"].tolist(), dtype=torch.float64)
        assert (lp.detach() - served).abs().max() < 1e-5
        sampler = torch.tensor(datum.loss_fn_inputs["logprobs"].tolist(), dtype=torch.float64)
        advantages = torch.tensor(datum.loss_fn_inputs["advantages"].tolist(), dtype=torch.float64)
        loss = loss - (torch.exp(lp - sampler) * advantages).sum()
    loss.backward()
    assert abs(answer.metrics["loss:sum"] - loss.item()) < 1e-5 * max(1.0, abs(loss.item()))
    grads = {k: p.grad for k, p in params.items()}
    ref_norm = torch.sqrt(sum((g**2).sum() for g in grads.values())).item()
    assert abs(grad_norm - ref_norm) < 1e-4 * ref_norm, (grad_norm, ref_norm)
    for k, g in grads.items():
        step = (after[k].double() - weights[k].double()) / lr
        clear = g.abs() > 1e-6  # Adam's first step is -sign(g) wherever |g| >> eps
        assert clear.any() and torch.equal(step[clear].sign(), -g[clear].sign()), k
        assert (step[clear].abs() - 1).abs().max() < 1e-3, k


def test_three_clients_with_different_learning_rates_train_concurrently_as_each_would_alone(service):
    """Three clients (same seed, so the same start) driven from three threads at once, interleaving their calls,
    end bit-identical to a client trained alone with the same learning rate."""
    url, out = service
    lrs = (1e-3, 1e-2, 3e-2)

    def train(lr: float) -> Any:
        tc = client(url).create_lora_training_client(base_model="tiny", rank=8, seed=5).result()
        for _ in range(3):
            tc.forward_backward(BATCH, "importance_sampling")
            tc.optim_step(types.AdamParams(learning_rate=lr))
        return state_of(folder_of(out, tc.save_state(f"lr-{lr}").result().path))

    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(train, lrs))
    alone = [train(lr) for lr in lrs]
    weights = [{k: v for k, v in s.items() if k.startswith("w/")} for s in together]
    for i in range(3):
        assert together[i].keys() == alone[i].keys()
        assert all(torch.equal(together[i][k], alone[i][k]) for k in alone[i]), f"lr {lrs[i]}"
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_server_capabilities_list_the_base_model(service):
    """The first call of Tinker's quickstart, through the SDK's RestClient (and the deprecated ServiceClient path)."""
    url, _ = service
    rest = tinker.ServiceClient(base_url=url, api_key="tml-local-test").create_rest_client()
    models = rest.get_server_capabilities().result().supported_models
    assert [(m.model_name, m.trainable, m.max_context_length) for m in models] == [("tiny", True, 256)]
