"""The service's sample request and response conversion (trainer/service/sampling.py), read back by the SDK's own
deserializer; refusals name the field and the value."""

from __future__ import annotations

import math
from typing import Any

import pytest

from inference.wire import Sample
from trainer.service.sampling import decode_sample, encode_sample
from trainer.service.wire import UserError

tinker = pytest.importorskip("tinker")
from tinker.proto.response_conv import deserialize_sample_response  # noqa: E402


def request(**over: Any) -> dict[str, Any]:
    body = {
        "sampling_session_id": "s:sample:0",
        "num_samples": 2,
        "prompt": {
            "chunks": [{"type": "encoded_text", "tokens": [1, 2]}, {"type": "encoded_text", "tokens": [3]}]
        },
        "sampling_params": {
            "max_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "stop": [7],
            "seed": 3,
        },
    }
    return {**body, **over}


def test_a_request_becomes_the_gateways_body():
    call = decode_sample(request(), vocab_size=100, context=64)
    assert call.prompt == [1, 2, 3] and call.num_samples == 2
    assert call.body == {
        "prompt": {"prompt_token_ids": [1, 2, 3]},
        "n": 2,
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "stop_token_ids": [7],
    }
    no_limit = decode_sample(request(sampling_params={"stop": []}), 100, 64)
    assert no_limit.body["max_tokens"] == 61 and no_limit.body["ignore_eos"] is True
    assert decode_sample(request(sampling_params={"max_tokens": 1, "stop": "x"}), 100, 64).body["stop"] == [
        "x"
    ]


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"prompt": {"chunks": [{"type": "image", "data": "..."}]}}, "chunk 0: type 'image'"),
        ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 100]}]}}, "token id 100 is outside"),
        ({"num_samples": 0}, "num_samples must be an integer from 1"),
        ({"sampling_params": {"max_tokens": 0}}, "max_tokens must be a positive integer"),
        ({"sampling_params": {"max_tokens": 2, "temperature": math.nan}}, "temperature"),
        ({"sampling_params": {"max_tokens": 2, "top_k": 0}}, "top_k must be -1"),
        ({"sampling_params": {"max_tokens": 2, "stop": [1, "a"]}}, "stop must be"),
        ({"topk_prompt_logprobs": 50}, "topk_prompt_logprobs must be an integer from 0 to 20"),
        ({"prompt_logprobs_last_n": 1}, "set prompt_logprobs"),
        ({"target_prompt_logprobs": {"data": [1]}}, "target_prompt_logprobs is not supported"),
        ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k is not supported"),
    ],
)
def test_refusals_name_the_field(over, match):
    with pytest.raises(UserError, match=match):
        decode_sample(request(**over), vocab_size=100, context=64)


def test_the_sdk_reads_back_samples_and_prompt_logprobs():
    call = decode_sample(
        request(prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=1), 100, 64
    )
    assert call.body["prompt_logprobs"] == 2
    positions: list[dict[int, float] | None] = [None, {2: -1.5, 9: -0.5, 4: -2.0}, {3: -0.25, 8: -3.0}]
    samples = [
        Sample(token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", prompt_logprobs=positions),
        Sample(token_ids=[7], logprobs=[-0.3], finish_reason="length", prompt_logprobs=positions),
    ]
    answer = deserialize_sample_response(encode_sample(call, samples))
    assert [s.tokens for s in answer.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in answer.sequences] == ["stop", "length"]
    assert answer.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert answer.prompt_logprobs == [None, None, -0.25]  # only the last 1 scored
    assert answer.topk_prompt_logprobs == [None, None, [(3, -0.25), (8, -3.0)]]
    full = decode_sample(request(prompt_logprobs=True, topk_prompt_logprobs=1), 100, 64)
    back = deserialize_sample_response(encode_sample(full, samples))
    assert back.prompt_logprobs == [None, -1.5, -0.25] and back.topk_prompt_logprobs[1] == [(9, -0.5)]


def test_the_gateway_config_file_is_private(tmp_path):
    """It may hold the publish token: readable by the run's user only, as the launcher writes RUN_DIR's files."""
    from tests.helpers import ROOT
    from trainer.orchestration.gateway_process import write_gateway_config

    out = tmp_path / "gateway.yaml"
    write_gateway_config(
        str(ROOT / "configs" / "tiny_cpu.yaml"), ["inference.publish_token=" + "t" * 24], out
    )
    assert (out.stat().st_mode & 0o777) == 0o600
