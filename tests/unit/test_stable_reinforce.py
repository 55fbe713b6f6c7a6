"""stable_reinforce end to end: the loss against a float64 reference (value and gradient), the sampler's records
(trainer/service/sampling.py), the provenance that names them in a training request (trainer/service/wire.py) with
refusals that name the field, and the unmodified SDK against the service app in this process: a sampling client
created with record_stability_info=True samples through a stand-in gateway (no vLLM: the service only forwards to
it), and a cookbook-style datum trains on what was recorded."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from fastapi import FastAPI

from inference.wire import Sample
from tests.helpers import loopback_socket, make_cfg, serve_app
from tests.unit.test_losses import REDUCTIONS, make_inputs, run_loss
from trainer.service.sampling import RECORD_OVERHEAD_BYTES, StabilityRecords, decode_sample, sequence_ids
from trainer.service.wire import UserError, decode_forward_backward
from trainer.training.loss_params import DEFAULT_KL_COEFF, LossParams

tinker = pytest.importorskip("tinker")
types = tinker.types
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

# --- the loss against float64 references ----------------------------------------------------------------------------


def reference_token(lp: float, lq: float, adv: float, kl: float, weight_at: float | None = None) -> float:
    """One token: REINFORCE weighted by the importance ratio truncated at 1 (taken at `weight_at`, the point the
    stop-gradient freezes), plus kl times the k3 estimate of KL(sampler || trainer)."""
    w = min(math.exp((lp if weight_at is None else weight_at) - lq), 1.0)
    r = math.exp(lp - lq)
    return -w * adv * lp + kl * (r - 1 - (lp - lq))


def reference(lp_BT, lq_BT, adv_BT, mask_BT, kl: float, reduction: str) -> tuple[float, torch.Tensor]:
    """Loss and d loss / d lp: the value summed per token in python floats; the gradient by central differences
    with the truncated weight held at its value (the stop-gradient)."""
    B, T = lp_BT.shape
    n_tokens = float(mask_BT.sum())
    total, grad, eps = 0.0, torch.zeros(B, T, dtype=torch.float64), 1e-6
    for b in range(B):
        seq_tokens = float(mask_BT[b].sum())
        scale = {
            "sum": 1.0,
            "token_mean": 1.0 / n_tokens,
            "seq_mean_token_sum": 1.0 / B,
            "seq_mean_token_mean": 1.0 / (seq_tokens * B),
        }[reduction]
        for t in range(T):
            m = float(mask_BT[b, t])
            if m == 0:
                continue
            lp, lq, adv = float(lp_BT[b, t]), float(lq_BT[b, t]), float(adv_BT[b, t])
            total += reference_token(lp, lq, adv, kl) * m * scale
            up = reference_token(lp + eps, lq, adv, kl, weight_at=lp)
            down = reference_token(lp - eps, lq, adv, kl, weight_at=lp)
            grad[b, t] = (up - down) / (2 * eps) * m * scale
    return total, grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kl", [0.0, DEFAULT_KL_COEFF, 0.5])
def test_value_and_grad_match_float64_reference(reduction, kl):
    lp, lq, adv, mask = make_inputs(seed=7, spread=0.6, dtype=torch.float64)
    mask[1, 2] = 0.5  # a fractional weight scales the token
    loss, grad, metrics = run_loss(lp, lq, adv, mask, LossParams("stable_reinforce", kl_coeff=kl), reduction)
    ref_value, ref_grad = reference(lp, lq, adv, mask, kl, reduction)
    # 1e-6: the reduction weights are float32 (compute_reduction_weights), the rest float64
    assert loss.item() == pytest.approx(ref_value, rel=1e-6, abs=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-6, atol=1e-8)
    truncated = int(((lp - lq).exp() > 1)[mask != 0].sum())
    assert 0 < truncated < int((mask != 0).sum())  # both branches of the truncation were exercised
    assert metrics["importance/clipped_tokens"] == truncated


def test_on_policy_gradient_is_reinforce_whatever_kl():
    lp, _, adv, mask = make_inputs(seed=3)
    _, is_grad, _ = run_loss(lp, lp, adv, mask, LossParams("importance_sampling"))
    for kl in (0.0, 1.0):
        loss, grad, metrics = run_loss(lp, lp, adv, mask, LossParams("stable_reinforce", kl_coeff=kl))
        assert torch.allclose(grad, is_grad) and torch.allclose(grad, -adv * mask)
        assert loss.item() == pytest.approx(-(adv * lp * mask).sum().item(), rel=1e-5)
        assert metrics["importance/mismatch_kl_sum"] == 0.0


def test_no_token_weighs_more_than_one_off_policy():
    """A token the trainer now likes far more than the sampler did keeps weight 1 (importance_sampling's would be
    e^6); kl_coeff = 0 leaves only that term, finite even where the ratio overflows."""
    lq = torch.tensor([[-8.0, -1.0, -0.5]])
    lp = torch.tensor([[-2.0, -1.0, -0.5]])
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones_like(lp)
    _, grad, _ = run_loss(lp, lq, adv, mask, LossParams("stable_reinforce", kl_coeff=0.0))
    assert torch.allclose(grad, -adv)
    far = torch.tensor([[-1.0, -1.0, -0.5]])
    loss, grad, _ = run_loss(
        far, torch.full_like(far, -200.0), adv, mask, LossParams("stable_reinforce", kl_coeff=0)
    )
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_masked_nan_stays_out_and_bad_kl_is_refused():
    lp, lq, adv, mask = make_inputs(seed=5)
    mask[0, 3] = 0.0
    clean, clean_grad, _ = run_loss(lp, lq, adv, mask, LossParams("stable_reinforce"))
    lp2, lq2, adv2 = lp.clone(), lq.clone(), adv.clone()
    lq2[0, 3], adv2[0, 3], lp2[0, 3] = math.nan, math.inf, math.nan
    dirty, dirty_grad, _ = run_loss(lp2, lq2, adv2, mask, LossParams("stable_reinforce"))
    assert dirty.item() == clean.item() and torch.equal(dirty_grad.nan_to_num(7.0), clean_grad)
    assert dirty_grad[0, 3] == 0
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="kl_coeff must be a finite number >= 0"):
            run_loss(lp, lq, adv, mask, LossParams("stable_reinforce", kl_coeff=bad))
    with pytest.raises(ValueError, match="tis_cap applies to ratio losses"):
        run_loss(lp, lq, adv, mask, LossParams("stable_reinforce", tis_cap=2.0))


# --- the sampler's records -----------------------------------------------------------------------------------------


def samples(n: int, length: int = 3) -> list[Sample]:
    return [
        Sample(
            token_ids=[40 + i + t for t in range(length)],
            logprobs=[-0.5 - 0.25 * i - 0.125 * t for t in range(length)],
            finish_reason="length",
        )
        for i in range(n)
    ]


def test_record_stability_info_is_a_boolean():
    body = {
        "sampling_session_id": "sess-0:sample:0",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4},
    }
    assert decode_sample(body, 100, 64).record_stability is False
    assert decode_sample({**body, "record_stability_info": None}, 100, 64).record_stability is False
    assert decode_sample({**body, "record_stability_info": True}, 100, 64).record_stability is True
    with pytest.raises(UserError, match=r"record_stability_info must be true or false, got 'yes'"):
        decode_sample({**body, "record_stability_info": "yes"}, 100, 64)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_records_live_a_day_after_their_last_use_and_stay_bounded():
    clock = Clock()
    per_record = RECORD_OVERHEAD_BYTES + 3 * 4 * 3  # prompt, tokens and logprobs of 3 each, 4 bytes apiece
    store = StabilityRecords(ttl_s=100.0, max_bytes=6 * per_record, clock=clock)
    a, b = sequence_ids("sess-1:sample:0", 5, 2)
    assert (a, b) == ("sess-1:sample:0:5:0", "sess-1:sample:0:5:1")
    store.record([a, b], [1, 2, 3], samples(2))
    rec = store.get(b)
    assert rec is not None and rec.prompt.tolist() == [1, 2, 3] and rec.tokens.tolist() == [41, 42, 43]
    assert rec.logprobs.dtype == np.float32 and rec.logprobs.tolist() == [-0.75, -0.875, -1.0]
    clock.now = 90.0
    assert store.get(a) is not None  # a use restarts a's time; b's is not restarted
    clock.now = 150.0
    assert store.get(b) is None and store.get(a) is not None
    clock.now = 260.0
    assert store.get(a) is None and len(store) == 0
    # Six records' bytes as the bound: the least recently used go first
    ids = sequence_ids("sess-1:sample:0", 6, 8)
    store.record(ids, [1, 2, 3], samples(8))
    assert len(store) == 6 and store.get(ids[0]) is None and store.get(ids[7]) is not None
    store.record(ids[:1], [9], samples(1, length=1))  # a retried request: the newest answer wins
    assert store.get(ids[0]).prompt.tolist() == [9]
    store.record(sequence_ids("sess-2:sample:0", 0, 1), [1], samples(1))
    store.forget("sess-1:")
    assert len(store) == 1
    with pytest.raises(RuntimeError, match="2 sequence ids for 1 samples"):
        store.record(ids[:2], [1], samples(1))
    # Tiny records are bounded by what they hold in memory, not by their few tokens.
    tiny = StabilityRecords(max_bytes=100 * (RECORD_OVERHEAD_BYTES + 12))
    for i in range(1000):
        tiny.record(sequence_ids("sess-3:sample:0", i, 1), [1], samples(1, length=1))
    assert len(tiny) == 100


# --- provenance in the training request ----------------------------------------------------------------------------

PROMPT = [5, 17, 23, 42]
SAMPLER = "sess-0:sample:1"


def recorded(n: int = 2, length: int = 3) -> tuple[StabilityRecords, list[str], list[Sample]]:
    store = StabilityRecords()
    ids = sequence_ids(SAMPLER, 0, n)
    got = samples(n, length)
    store.record(ids, PROMPT, got)
    return store, ids, got


def cookbook_datum(sequence_id: str, sampled: list[int], advantage: float, **over: Any) -> Any:
    """As tinker_cookbook's recipes/rl_loop.py builds a stable_reinforce datum: prompt + all but the last sampled
    token in, the same shifted by one as targets, provenance over both."""
    ob = len(PROMPT) - 1
    inputs = {
        "target_tokens": PROMPT[1:] + sampled,
        "logprobs": [0.0] * ob + [-9.0] * len(sampled),  # not read: the recorded logprobs are
        "advantages": [0.0] * ob + [advantage] * len(sampled),
        **over,
    }
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + sampled[:-1]), loss_fn_inputs=inputs)
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=len(sampled) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=len(sampled)),
        ],
    )


def decode(
    data: list[Any], store: StabilityRecords, config: dict[str, float] | None = None, model="sess-0:train:0"
):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="stable_reinforce", loss_fn_config=config
        ),
        model_id=model,
        seq_id=1,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    return decode_forward_backward(body, vocab_size=100, records=store.get)[3]


def test_provenance_selects_the_sampled_tokens_and_their_recorded_logprobs():
    store, ids, got = recorded()
    call = decode([cookbook_datum(ids[1], got[1].token_ids, 1.5)], store, {"kl_coeff": 0.2})
    assert not isinstance(call, UserError), call
    (ex,) = call.examples
    ob = len(PROMPT) - 1
    assert call.loss == LossParams("stable_reinforce", kl_coeff=0.2)
    assert ex.loss_mask == [0.0] * ob + [1.0] * 3
    assert ex.sampler_logprobs[:ob] == [0.0] * ob
    assert ex.sampler_logprobs[ob:] == pytest.approx(got[1].logprobs)
    assert ex.advantages == [0.0] * ob + [1.5] * 3
    assert decode([cookbook_datum(ids[0], got[0].token_ids, 1.0)], store).loss.kl_coeff == DEFAULT_KL_COEFF


def respan(datum: Any, model_input: list[Any] | None = None, targets: list[Any] | None = None) -> Any:
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs=datum.loss_fn_inputs,
        model_input_spans=model_input if model_input is not None else datum.model_input_spans,
        loss_fn_input_spans=targets if targets is not None else datum.loss_fn_input_spans,
    )


def refusals() -> list[tuple[str, Any, dict[str, float] | None, str, str]]:
    """(what, datum builder, loss_fn_config, model id, the message it must match)."""
    P, S = types.PromptProvenanceSpan, types.SampledProvenanceSpan

    def base(ids, got):
        return cookbook_datum(ids[0], got[0].token_ids, 1.0)

    return [
        (
            "no provenance",
            lambda ids, got: types.Datum(
                model_input=base(ids, got).model_input, loss_fn_inputs=base(ids, got).loss_fn_inputs
            ),
            None,
            "sess-0:train:0",
            r"data\[0\]: loss_fn 'stable_reinforce' needs provenance: attach it with Datum.with_provenance",
        ),
        (
            "unknown sequence",
            lambda ids, got: cookbook_datum(SAMPLER + ":9:0", got[0].token_ids, 1.0),
            None,
            "sess-0:train:0",
            r"data\[0\]\.model_input_spans\[0\]: sequence_id 'sess-0:sample:1:9:0' has no stability record here; "
            r"sample it from a sampling client created with record_stability_info=True",
        ),
        (
            "another session",
            base,
            None,
            "sess-3:train:0",
            r"model_input_spans\[0\]: sequence_id 'sess-0:sample:1:0:0' was not sampled in this training client's "
            r"session \(sess-3\)",
        ),
        (
            "a tampered target",
            lambda ids, got: cookbook_datum(ids[0], [40, 99, 42], 1.0),
            None,
            "sess-0:train:0",
            r"model_input_spans\[1\]: position 5 holds token 99, but sequence 'sess-0:sample:1:0:0' has 41 at "
            r"sampled offset 1",
        ),
        (
            "runs short of the field",
            lambda ids, got: respan(
                base(ids, got),
                targets=[P(sequence_id=ids[0], offset=1, length=3), S(sequence_id=ids[0], length=2)],
            ),
            None,
            "sess-0:train:0",
            r"data\[0\]\.loss_fn_input_spans: the runs cover 5 positions, but the field has 6; they must tile it",
        ),
        (
            "runs past the field",
            lambda ids, got: respan(
                base(ids, got),
                targets=[P(sequence_id=ids[0], offset=1, length=3), S(sequence_id=ids[0], length=4)],
            ),
            None,
            "sess-0:train:0",
            r"loss_fn_input_spans\[1\]: the runs cover more than the field's 6 positions",
        ),
        (
            "past the sequence",
            lambda ids, got: respan(
                base(ids, got),
                targets=[
                    P(sequence_id=ids[0], offset=1, length=2),
                    S(sequence_id=ids[0], offset=1, length=4),
                ],
            ),
            None,
            "sess-0:train:0",
            r"loss_fn_input_spans\[1\]: offset 1 \+ length 4 runs past the 3 sampled tokens of sequence",
        ),
        (
            "nothing sampled",
            lambda ids, got: respan(
                types.Datum(
                    model_input=types.ModelInput.from_ints(PROMPT[:3]),
                    loss_fn_inputs={"target_tokens": PROMPT[1:], "advantages": [1.0] * 3},
                ),
                model_input=[P(sequence_id=ids[0], length=3)],
                targets=[P(sequence_id=ids[0], offset=1, length=3)],
            ),
            None,
            "sess-0:train:0",
            r"loss_fn_input_spans: no run is a SampledProvenanceSpan, so no target is a sampled token",
        ),
        (
            "no advantages",
            lambda ids, got: respan(
                types.Datum(
                    model_input=base(ids, got).model_input,
                    loss_fn_inputs={"target_tokens": PROMPT[1:] + got[0].token_ids},
                ),
                model_input=base(ids, got).model_input_spans,
                targets=base(ids, got).loss_fn_input_spans,
            ),
            None,
            "sess-0:train:0",
            r"data\[0\]: loss_fn 'stable_reinforce' needs loss_fn_inputs\['advantages'\]",
        ),
        (
            "negative kl_coeff",
            base,
            {"kl_coeff": -1.0},
            "sess-0:train:0",
            r"loss_fn_config\['kl_coeff'\] = -1\.0: send a finite number >= 0",
        ),
        (
            "NaN kl_coeff",
            base,
            {"kl_coeff": math.nan},
            "sess-0:train:0",
            r"loss_fn_config\['kl_coeff'\] = nan",
        ),
        (
            "a key it does not take",
            base,
            {"clip_low_threshold": 0.5},
            "sess-0:train:0",
            r"do not apply to 'stable_reinforce' \(it takes: \['kl_coeff'\]\)",
        ),
        (
            "a flood of empty runs",  # a million of them once held the service's event loop 2.6 s
            lambda ids, got: respan(base(ids, got), model_input=[P(sequence_id=ids[0], length=0)] * 100_000),
            None,
            "sess-0:train:0",
            r"data\[0\]\.model_input_spans: 100000 runs for 6 positions; runs tile the field",
        ),
    ]


@pytest.mark.parametrize(
    ("what", "build", "config", "model", "match"), refusals(), ids=[r[0] for r in refusals()]
)
def test_refusals_name_the_field_the_value_and_what_to_do(what, build, config, model, match):
    store, ids, got = recorded()
    call = decode([build(ids, got)], store, config, model)
    assert isinstance(call, UserError), what
    assert re.search(match, str(call)), str(call)


# --- the SDK against the service app, sampling through a stand-in gateway -------------------------------------------

GATEWAY_LOGPROBS = [-0.7, -1.9, -0.05, -3.0]


def stand_in_gateway() -> FastAPI:
    """What the service asks of the gateway (GET /v1/models, POST /adapters/load|unload|generate), answering fixed
    samples: sample i is tokens 60+i, 61+i, 62+i, 63+i with GATEWAY_LOGPROBS shifted by -0.1 i."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "tiny", "max_model_len": 64}]}

    @app.post("/adapters/load")
    @app.post("/adapters/unload")
    async def load() -> dict[str, Any]:
        return {}

    @app.post("/adapters/generate")
    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        n = int(body["n"])
        return {
            "adapter": body.get("adapter"),
            "samples": [
                {
                    "token_ids": [60 + i + t for t in range(4)],
                    "logprobs": [lp - 0.1 * i for lp in GATEWAY_LOGPROBS],
                    "finish_reason": "length",
                }
                for i in range(n)
            ],
        }

    return app


@pytest.fixture(scope="module")
def service_url(tmp_path_factory) -> Iterator[str]:
    from trainer.service.policies import MultiLora
    from trainer.service.routes import build_app

    with serve_app(stand_in_gateway(), loopback_socket()) as gateway:
        cfg = make_cfg(
            tmp_path_factory.mktemp("service"),
            service__output_dir=str(tmp_path_factory.mktemp("out")),
            service__gateway_url=gateway,
        )
        with serve_app(build_app(cfg, MultiLora(cfg)), loopback_socket()) as url:
            yield url


def test_sdk_samples_with_stability_info_and_trains_stable_reinforce(service_url):
    sc = tinker.ServiceClient(base_url=service_url, api_key="tml-local-test")
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    response = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=1.0)).result()
    assert isinstance(response, types.SampleResponse) and len(response.sequences) == 2
    seqs = response.sequences
    assert [s.tokens for s in seqs] == [[60, 61, 62, 63], [61, 62, 63, 64]]
    assert seqs[1].logprobs == pytest.approx([lp - 0.1 for lp in GATEWAY_LOGPROBS])
    assert len({s.sequence_id for s in seqs}) == 2 and all(s.sequence_id for s in seqs)

    datums = [cookbook_datum(s.sequence_id, s.tokens, adv) for s, adv in zip(seqs, (1.0, -1.0), strict=True)]
    out = tc.forward(datums, "stable_reinforce", {"kl_coeff": 0.3}).result()
    ob = len(PROMPT) - 1
    lp = torch.from_numpy(
        np.stack([np.asarray(o["logprobs"].data)[ob:] for o in out.loss_fn_outputs])
    ).double()
    lq = torch.tensor(
        [s.logprobs for s in seqs], dtype=torch.float64
    )  # the recorded ones, not the datum's -9
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    ref, _ = reference(lp, lq, adv, torch.ones_like(lp), 0.3, "sum")
    assert out.metrics["loss:sum"] == pytest.approx(ref, rel=1e-5)
    assert np.isfinite(tc.forward_backward(datums, "stable_reinforce").result().metrics["loss:sum"])
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    tampered = cookbook_datum(seqs[0].sequence_id, [60, 61, 99, 63], 1.0)
    with pytest.raises(
        tinker.RequestFailedError, match=r"position 6 holds token 99, but sequence '.*' has 62"
    ):
        tc.forward_backward([datums[0], tampered], "stable_reinforce").result()
    plain = tc.save_weights_and_get_sampling_client().result()  # no record_stability_info: nothing recorded
    unrecorded = plain.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result().sequences[0]
    with pytest.raises(tinker.RequestFailedError, match=r"has no stability record here"):
        tc.forward(
            [cookbook_datum(unrecorded.sequence_id, unrecorded.tokens, 1.0)], "stable_reinforce"
        ).result()
    # The refused calls took their places in line: the client goes on.
    assert np.isfinite(tc.forward(datums, "stable_reinforce").result().metrics["loss:sum"])
