"""gspo and (N, K) cross_entropy targets in the service: the SDK's own request encoder and response decoder around
trainer/service/wire.py, then the unmodified SDK against the service app in this process (tiny model, CPU): the
answers' shapes, the losses against the float64 references of test_losses, and refusals that name the field."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import make_cfg, serve_app
from tests.unit.test_losses import reference_gspo
from trainer.service.wire import UserError, decode_forward_backward, encode_forward_backward
from trainer.training.loss_params import LossParams

tinker = pytest.importorskip("tinker")
types = tinker.types
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

N, K = 5, 3


def body(data: list[Any], loss_fn: str, config: dict[str, float] | None = None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=1,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def decode(data: list[Any], loss_fn: str, config: dict[str, float] | None = None) -> Any:
    _, _, _, call = decode_forward_backward(body(data, loss_fn, config), vocab_size=100)
    return call


def soft_datum(targets: Any, weights: Any | None = None) -> Any:
    inputs = {"target_tokens": targets} if weights is None else {"target_tokens": targets, "weights": weights}
    return types.Datum(model_input=types.ModelInput.from_ints(list(range(1, N + 1))), loss_fn_inputs=inputs)


def rl_datum(**extra: Any) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, N + 1))),
        loss_fn_inputs={
            "target_tokens": list(range(2, N + 2)),
            "logprobs": [-1.0] * N,
            "advantages": [1.0] * N,
            **extra,
        },
    )


IDS = np.arange(N * K, dtype=np.int64).reshape(N, K) + 3
WEIGHTS = np.linspace(0.1, 0.9, N * K, dtype=np.float32).reshape(N, K)


@pytest.mark.parametrize(
    "dense", [True, False]
)  # numpy goes dense; a 2-D torch target_tokens goes sparse CSR
def test_n_by_k_targets_decode_as_soft_targets(dense):
    targets = IDS if dense else torch.from_numpy(IDS)
    weights = WEIGHTS if dense else torch.from_numpy(WEIGHTS)
    call = decode([soft_datum(targets, weights), soft_datum(list(range(2, N + 2)))], "cross_entropy")
    assert not isinstance(call, UserError), call
    soft, plain = call.soft_targets
    assert plain is None and call.examples[1].target_ids == list(range(2, N + 2))
    assert np.array_equal(soft.target_ids, IDS) and np.array_equal(soft.weights, WEIGHTS)
    assert call.examples[0].target_ids == IDS[:, 0].tolist()
    no_weights = decode([soft_datum(IDS)], "cross_entropy").soft_targets[0]
    assert np.array_equal(no_weights.weights, np.ones((N, K), np.float32))


def test_gspo_decodes_its_sequence_ratio_mask_and_clip_config():
    mask = [0.0, 1.0, 1.0, 0.0, 1.0]
    call = decode([rl_datum(sequence_ratio_mask=mask)], "gspo", {"clip_low_threshold": 0.5})
    assert not isinstance(call, UserError), call
    assert call.sequence_masks == [mask] and call.loss.clip_bounds() == (0.5, 1.2)


@pytest.mark.parametrize(
    ("data", "loss_fn", "match"),
    [
        (
            [soft_datum(IDS, WEIGHTS[:, 0])],
            "cross_entropy",
            r"data\[0\]\.loss_fn_inputs\['weights'\]: shape \[5\], but target_tokens has shape \[5, 3\]; send one "
            r"weight per target token",
        ),
        (
            [soft_datum(IDS[:, 0], WEIGHTS)],
            "cross_entropy",
            r"\['weights'\]: shape \[5, 3\], but target_tokens has shape \[5\]; send one weight per target token",
        ),
        (
            [soft_datum(IDS[:4], WEIGHTS[:4])],
            "cross_entropy",
            r"'target_tokens'\]: shape \[4, 3\], but model_input has 5 tokens; send \[5\].* or \[5, K\]",
        ),
        (
            [soft_datum(IDS + 100, WEIGHTS)],
            "cross_entropy",
            r"data\[0\]\.target_tokens has token id 103, outside the vocabulary \[0, 100\)",
        ),
        (
            [soft_datum(IDS, np.where(WEIGHTS > 0.5, np.nan, WEIGHTS))],
            "cross_entropy",
            r"\['weights'\] holds NaN",
        ),
        (
            [rl_datum(target_tokens=IDS)],
            "ppo",
            r"'target_tokens'\]: shape \[5, 3\] \(K targets per position\) applies to loss_fn 'cross_entropy' only",
        ),
        (
            [rl_datum(sequence_ratio_mask=[1.0] * 4)],
            "gspo",
            r"\['sequence_ratio_mask'\]: shape \[4\], but model_input has 5 tokens",
        ),
        (
            [rl_datum(sequence_ratio_mask=[1.0, np.inf, 1, 1, 1])],
            "gspo",
            r"'sequence_ratio_mask'\] holds NaN or inf",
        ),
        (
            [rl_datum()],
            "stable_reinforce",
            r"data\[0\]: loss_fn 'stable_reinforce' needs provenance",
        ),
    ],
)
def test_refusals_name_the_field_the_shape_and_what_to_send(data, loss_fn, match):
    call = decode(data, loss_fn)
    assert isinstance(call, UserError)
    assert re.search(match, str(call)), str(call)


def test_gspo_refuses_config_keys_it_does_not_take():
    call = decode([rl_datum(sequence_ratio_mask=[1.0] * 5)], "gspo", {"tis_cap": 2.0})
    assert isinstance(call, UserError) and "do not apply to 'gspo'" in str(call)


def test_the_sdk_reads_back_n_and_n_by_k_logprobs_in_order():
    answers = [
        np.arange(4, dtype=np.float32),
        np.arange(6, dtype=np.float32).reshape(3, 2),
        np.arange(8, dtype=np.float32).reshape(4, 2),
        np.arange(3, dtype=np.float32).reshape(1, 3),
        np.arange(2, dtype=np.float32),
    ]
    out = deserialize_forward_backward_output(encode_forward_backward(answers, {"loss:sum": 1.5}))
    assert out.metrics == {"loss:sum": 1.5}
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[4], [3, 2], [4, 2], [1, 3], [2]]
    for got, want in zip(out.loss_fn_outputs, answers, strict=True):
        assert np.array_equal(np.asarray(got["logprobs"].data).reshape(want.shape), want)


# --- the SDK against the service app, in this process --------------------------------------------------------------


@pytest.fixture(scope="module")
def service_url(tmp_path_factory) -> Iterator[str]:
    from trainer.service.policies import MultiLora
    from trainer.service.routes import build_app

    cfg = make_cfg(
        tmp_path_factory.mktemp("service"), service__output_dir=str(tmp_path_factory.mktemp("out"))
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    with serve_app(build_app(cfg, MultiLora(cfg)), sock) as url:
        yield url


@pytest.fixture(scope="module")
def training_client(service_url) -> Any:
    sc = tinker.ServiceClient(base_url=service_url, api_key="tml-local-test")
    return sc.create_lora_training_client(base_model="tiny", rank=4).result()


TOKENS = [5, 17, 23, 42, 42, 7, 9]


def column_logprobs(tc: Any, targets: np.ndarray) -> np.ndarray:
    """Each column of (N, K) targets scored as a plain (N,) datum: the reference for the (N, K) answers."""
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS),
            loss_fn_inputs={"target_tokens": targets[:, k].tolist(), "weights": [0.0] * len(TOKENS)},
        )
        for k in range(targets.shape[1])
    ]
    out = tc.forward(data, "cross_entropy").result()
    return np.stack([np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs], axis=1)


def test_sdk_forward_and_custom_loss_with_n_by_k_targets(training_client):
    tc = training_client
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 2048, size=(len(TOKENS), 4))
    weights = rng.random((len(TOKENS), 4)).astype(np.float32)
    soft = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS),
        loss_fn_inputs={"target_tokens": torch.from_numpy(targets), "weights": torch.from_numpy(weights)},
    )
    expected_lp = column_logprobs(tc, targets)
    plain = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS),
        loss_fn_inputs={"target_tokens": targets[:, 1].tolist(), "weights": [0.5] * len(TOKENS)},
    )
    out = tc.forward([soft, plain], "cross_entropy").result()  # one micro-batch holds both forms
    got, got_plain = (o["logprobs"] for o in out.loss_fn_outputs)
    assert got.shape == [len(TOKENS), 4] and got_plain.shape == [len(TOKENS)]
    got_lp = np.asarray(got.data).reshape(len(TOKENS), 4)
    assert np.abs(got_lp - expected_lp).max() < 1e-5
    assert np.abs(np.asarray(got_plain.data) - expected_lp[:, 1]).max() < 1e-5
    expected_loss = -(weights * expected_lp).sum() - 0.5 * expected_lp[:, 1].sum()
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)

    seen: list[torch.Tensor] = []

    def soft_ce(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        seen.extend(logprobs)
        w = data[0].loss_fn_inputs["weights"].to_torch()
        return -(w * logprobs[0]).sum(), {}

    custom = tc.forward_backward_custom([soft], soft_ce).result()
    assert seen[0].shape == (len(TOKENS), 4)
    assert custom.metrics["loss:sum"] == pytest.approx(-(weights * expected_lp).sum(), rel=1e-5)
    # The custom loss's backward is a cross_entropy with weights -dC/dlogprobs = the weights: the same surrogate.
    assert custom.metrics["surrogate_loss:sum"] == pytest.approx(custom.metrics["loss:sum"], rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_sdk_gspo_matches_the_float64_reference(training_client):
    tc = training_client
    n = len(TOKENS) - 1
    sampler = [-2.0, -3.5, -1.0, -4.0, -2.5, -3.0]
    datums, masks = [], ([0.0, 0.0, 1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    for sign, mask in zip((1.0, -1.0), masks, strict=True):
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                loss_fn_inputs={
                    "target_tokens": TOKENS[1:],
                    "logprobs": sampler,
                    "advantages": [0.0, 0.0] + [sign] * (n - 2),
                    "sequence_ratio_mask": mask,
                },
            )
        )
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    out = tc.forward(datums, "gspo", config).result()
    lp = torch.tensor(
        np.stack([np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs]), dtype=torch.float64
    )
    lq = torch.tensor([sampler, sampler], dtype=torch.float64)
    adv = torch.tensor([d.loss_fn_inputs["advantages"].tolist() for d in datums], dtype=torch.float64)
    ref, _ = reference_gspo(
        lp, lq, adv, torch.ones_like(lp), torch.tensor(masks), LossParams("gspo", 0.9, 1.1), "sum"
    )
    assert out.metrics["loss:sum"] == pytest.approx(ref, rel=1e-5)
    # Without sequence_ratio_mask (tinker-cookbook's RL loop sends none): the positions with a sampler logprob or
    # an advantage, here the sampled tokens 2-5, as if that mask had been sent.
    cookbook_sampler = [0.0, 0.0, -1.0, -4.0, -2.5, -3.0]
    bare, explicit = (
        types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={
                "target_tokens": TOKENS[1:],
                "logprobs": cookbook_sampler,
                "advantages": [0.0, 0.0] + [1.0] * (n - 2),
                **extra,
            },
        )
        for extra in ({}, {"sequence_ratio_mask": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]})
    )
    got = tc.forward([bare], "gspo", config).result().metrics["loss:sum"]
    assert got == pytest.approx(tc.forward([explicit], "gspo", config).result().metrics["loss:sum"], rel=1e-6)
    assert np.isfinite(tc.forward_backward(datums, "gspo").result().metrics["loss:sum"])
