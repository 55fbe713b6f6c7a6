"""Groups sampled from the tiny model go through a real Atropos run-api process and come back as the batch
the trainer converts: the wire shape the unit tests' fixture stands for."""

from __future__ import annotations

import json

import pytest

from tests.helpers import FIXTURE, build_scored_groups, roundtrip_through_run_api, run_api
from trainer.training.batch import (
    IntakeOptions,
    convert_batch,
    parse_batch_response,
)

OPTS = IntakeOptions(vocab_size=2048, max_seq_len=64)


@pytest.fixture(scope="module")
def groups() -> list[dict]:
    body = json.loads(FIXTURE.read_text())
    batch = parse_batch_response(body)
    assert batch is not None
    return batch


def test_live_run_api_roundtrip_matches_converted_fixture(tmp_path, tiny_model_path):
    """Post groups to Atropos's real run-api and convert what GET /batch returns."""
    posted = build_scored_groups(tiny_model_path)
    with run_api(tmp_path) as url:
        body = roundtrip_through_run_api(url, posted)
    batch = parse_batch_response(body)
    assert batch is not None and sum(len(g["tokens"]) for g in batch) == 16
    assert sorted(json.dumps(g["tokens"]) for g in batch) == sorted(json.dumps(g["tokens"]) for g in posted)
    assert set(batch[0]) >= {"tokens", "masks", "scores", "inference_logprobs", "overrides", "env_id"}
    out = convert_batch(batch, OPTS)
    assert len(out.examples) == 12 and out.drops == []
