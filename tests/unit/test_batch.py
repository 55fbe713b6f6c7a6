"""Atropos batch intake: conversion of real run-api batches, and every bad-input case dropped and named."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest

from tests.helpers import FIXTURE
from trainer.training.batch import (
    IntakeOptions,
    ScoredDataGroup,
    compute_group_advantages,
    convert_batch,
    examples_to_tensors,
    parse_batch_response,
    plan_micro_batches,
    resolve_temperature,
)
from trainer.training.losses import BatchScale

OPTS = IntakeOptions(vocab_size=2048, max_seq_len=64)


@pytest.fixture(scope="module")
def groups() -> list[dict]:
    body = json.loads(FIXTURE.read_text())
    batch = parse_batch_response(body)
    assert batch is not None
    return batch


def test_fixture_converts_with_shift_masks_and_advantages(groups):
    out = convert_batch(groups, OPTS)
    assert out.groups_received == 4 and out.sequences_received == 16
    assert out.groups_zero_variance == 1  # group 1 scored all 1.0
    assert out.drops == []
    assert len(out.examples) == 12
    for ex in out.examples:
        g = groups[ex.group_index]
        tokens, masks = g["tokens"][ex.sequence_index], g["masks"][ex.sequence_index]
        lps = g["inference_logprobs"][ex.sequence_index]
        assert ex.input_ids == tokens[:-1] and ex.target_ids == tokens[1:]
        for t, m in enumerate(ex.loss_mask):
            trained = masks[t + 1] != -100
            assert m == (1.0 if trained else 0.0)
            # sampler logprob at position t is the logprob of target t+1, not the 1.0 prompt placeholder
            assert ex.sampler_logprobs[t] == (lps[t + 1] if trained else 0.0)
        assert all(lp < 0 for lp, m in zip(ex.sampler_logprobs, ex.loss_mask, strict=False) if m)
    by_seq = {(e.group_index, e.sequence_index): e for e in out.examples}
    # group 0: scores [0, 1, 0, 1] -> advantages -0.5 / +0.5 on every trained token, 0 on the prompt
    scores0 = groups[0]["scores"]
    for si, s in enumerate(scores0):
        ex = by_seq[(0, si)]
        assert {a for a, m in zip(ex.advantages, ex.loss_mask, strict=False) if m} == {s - sum(scores0) / 4}
        assert all(a == 0 for a, m in zip(ex.advantages, ex.loss_mask, strict=False) if not m)
    # group 2 sends token-level advantages: used as sent, shifted by one
    for si in range(4):
        ex = by_seq[(2, si)]
        assert ex.advantages == [
            a if m else 0.0 for a, m in zip(groups[2]["advantages"][si][1:], ex.loss_mask, strict=False)
        ]
    # group 3 seq 0 carries set_advantage_to_zero
    assert groups[3]["overrides"][0] == {"set_advantage_to_zero": True}
    assert all(a == 0 for a in by_seq[(3, 0)].advantages)
    assert any(a != 0 for a in by_seq[(3, 1)].advantages)
    metrics = out.metrics()
    assert metrics["rollouts/sequences_trained"] == 12 and metrics["rollouts/groups_zero_variance"] == 1


def test_zero_variance_sequences_count_in_the_batch_scale(groups):
    """The mean reductions divide by every well-formed sequence the step took: group 1 (all rewards equal) is not
    trained but its 4 sequences and their completion tokens are in the scale; one too long to train is not."""
    out = convert_batch(groups, OPTS)
    zero_tokens = [sum(1 for m in masks[1:] if m != -100) for masks in groups[1]["masks"]]
    own_tokens = sum(sum(e.loss_mask) for e in out.examples)
    assert out.scale() == BatchScale(12 + 4, own_tokens + sum(zero_tokens))
    longest = max(len(t) for t in groups[1]["tokens"])
    n_longest = sum(len(t) == longest for t in groups[1]["tokens"])
    shorter = dataclasses.replace(OPTS, max_seq_len=longest - 1, overlong="drop")
    dropped = convert_batch(groups, shorter)
    assert dropped.zero_variance_sequences == 4 - n_longest
    truncated = convert_batch(groups, dataclasses.replace(OPTS, max_seq_len=longest - 1))
    assert truncated.zero_variance_sequences == 4 and truncated.zero_variance_tokens < sum(zero_tokens)


def test_std_normalisation_and_grpo_style_advantages():
    adv = compute_group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True, std_eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert compute_group_advantages([3.0, 1.0], False, 1e-6) == [1.0, -1.0]


def test_temperature_priority():
    g = ScoredDataGroup(
        tokens=[[1, 2], [1, 2]],
        masks=[[-100, 2], [-100, 2]],
        scores=[0, 1],
        overrides=[{"temperature": 0.5}, {}],
        generation_params={"temperature": 0.7},
        group_overrides={"temperature": 0.9},
    )
    assert resolve_temperature(g, 0) == 0.5 and resolve_temperature(g, 1) == 0.7
    g2 = g.model_copy(update={"generation_params": None})
    assert resolve_temperature(g2, 1) == 0.9
    g3 = g2.model_copy(update={"group_overrides": None})
    assert resolve_temperature(g3, 1) == 1.0


def _mutate(groups, fn):
    bad = copy.deepcopy(groups)
    fn(bad)
    return bad


GROUP_DROPS = [
    ("masks", lambda b: b[0]["masks"][1].pop()),
    ("inference_logprobs", lambda b: b[0]["inference_logprobs"].pop()),
    ("scores", lambda b: b[0]["scores"].append(1.0)),
    ("scores", lambda b: b[0]["scores"].__setitem__(2, math.nan)),
    ("scores", lambda b: b[0]["scores"].__setitem__(2, math.inf)),
    ("tokens", lambda b: b[0]["tokens"][3].__setitem__(2, 5000)),
    ("tokens", lambda b: b[0]["tokens"][3].__setitem__(2, -1)),
    ("inference_logprobs", lambda b: b[0].__setitem__("inference_logprobs", None)),
    ("tokens", lambda b: b[0].__setitem__("tokens", "not a list")),
]


@pytest.mark.parametrize("field,mutate", GROUP_DROPS)
def test_bad_group_is_dropped_and_named(groups, field, mutate):
    out = convert_batch(_mutate(groups, mutate), OPTS)
    assert len(out.drops) == 1, [str(d) for d in out.drops]
    drop = out.drops[0]
    assert drop.group_index == 0 and drop.sequence_index is None and drop.field.startswith(field)
    assert str(drop).startswith("group 0, field")
    # nothing else is lost: groups 2 and 3 still give their 8 sequences
    assert len(out.examples) == 8 and {e.group_index for e in out.examples} == {2, 3}
    assert out.metrics()["rollouts/groups_dropped_malformed"] == 1


SEQ_DROPS = [
    ("inference_logprobs", lambda b: b[0]["inference_logprobs"][1].__setitem__(-1, math.nan), "nan"),
    ("inference_logprobs", lambda b: b[0]["inference_logprobs"][1].__setitem__(-2, -math.inf), "-inf"),
    ("masks", lambda b: b[0]["masks"].__setitem__(1, [-100] * len(b[0]["tokens"][1])), "no trained token"),
    ("masks", lambda b: b[0]["masks"][1].__setitem__(-1, 7), "position"),
    (
        "tokens",
        lambda b: (
            b[0]["tokens"][1].extend([5] * 60),
            b[0]["masks"][1].extend([5] * 60),
            b[0]["inference_logprobs"][1].extend([-1.0] * 60),
        ),
        "max_seq_len",
    ),
]


@pytest.mark.parametrize("field,mutate,reason", SEQ_DROPS)
def test_bad_sequence_is_dropped_rest_of_group_trains(groups, field, mutate, reason):
    out = convert_batch(_mutate(groups, mutate), dataclasses.replace(OPTS, overlong="drop"))
    assert len(out.drops) == 1
    drop = out.drops[0]
    assert (drop.group_index, drop.sequence_index, drop.field) == (0, 1, field)
    assert reason in drop.reason
    assert len(out.examples) == 11
    assert (0, 1) not in {(e.group_index, e.sequence_index) for e in out.examples}
    # the group's other sequences keep advantages computed from all four scores
    ex = next(e for e in out.examples if (e.group_index, e.sequence_index) == (0, 0))
    assert {a for a, m in zip(ex.advantages, ex.loss_mask, strict=False) if m} == {-0.5}


def test_overlong_sequence_trains_its_first_max_seq_len_tokens(groups):
    """The default: a sequence past max_seq_len (a completion cut at the environment's budget, say) is not lost;
    its head trains with the sampler's logprobs and advantages of those positions, its tail gets no loss."""
    longer = _mutate(
        groups,
        lambda b: (
            b[0]["tokens"][1].extend([5] * 60),
            b[0]["masks"][1].extend([5] * 60),
            b[0]["inference_logprobs"][1].extend([-1.0] * 60),
        ),
    )
    out = convert_batch(longer, OPTS)
    assert out.drops == [] and len(out.examples) == 12
    ex = next(e for e in out.examples if (e.group_index, e.sequence_index) == (0, 1))
    head = longer[0]["tokens"][1][:64]
    assert ex.input_ids == head[:-1] and ex.target_ids == head[1:] and len(ex.loss_mask) == 63
    assert ex.sampler_logprobs == [
        v if m else 0.0 for v, m in zip(longer[0]["inference_logprobs"][1][1:64], ex.loss_mask, strict=True)
    ]
    assert out.metrics()["rollouts/sequences_truncated"] == 1


def test_empty_optional_fields_mean_absent(groups):
    """atroposlib's default collect_trajectories (one collect_trajectory per sequence) sends [] for advantages,
    ref_logprobs, messages and overrides that no item filled in."""
    bare = [{**g, "advantages": [], "ref_logprobs": [], "messages": [], "overrides": []} for g in groups]
    out = convert_batch(bare, OPTS)
    assert out.drops == [] and len(out.examples) == len(convert_batch(groups, OPTS).examples)


def test_nan_logprob_at_prompt_position_is_harmless(groups):
    bad = _mutate(groups, lambda b: b[0]["inference_logprobs"][0].__setitem__(2, math.nan))
    out = convert_batch(bad, OPTS)
    assert out.drops == [] and len(out.examples) == 12


def test_cross_entropy_batches_need_no_sampler_logprobs(groups):
    bare = _mutate(groups, lambda b: [g.__setitem__("inference_logprobs", None) for g in b])
    out = convert_batch(bare, IntakeOptions(vocab_size=2048, max_seq_len=64, require_sampler_logprobs=False))
    assert out.drops == [] and len(out.examples) == 12


def test_parse_batch_response():
    assert parse_batch_response({"batch": None}) is None
    assert parse_batch_response({"status": "error", "message": "Trainer not registered", "batch": []}) is None
    assert parse_batch_response({"batch": [{"tokens": []}]}) == [{"tokens": []}]
    with pytest.raises(ValueError, match="no 'batch' key"):
        parse_batch_response({"detail": "oops"})


def test_examples_to_tensors_pads_with_mask_zero(groups):
    out = convert_batch(groups, OPTS)
    t = examples_to_tensors(out.examples[:3])
    widths = [len(e) for e in out.examples[:3]]
    assert t["input_ids_BT"].shape == (3, max(widths))
    for b, w in enumerate(widths):
        assert t["mask_BT"][b, w:].sum() == 0 and t["attention_mask_BT"][b, :w].all()


def test_plan_micro_batches_respects_token_budget():
    lengths = [10, 50, 20, 30, 5, 45]
    plans = plan_micro_batches(lengths, 100)
    assert sorted(i for p in plans for i in p) == list(range(6))
    for p in plans:
        assert len(p) * max(lengths[i] for i in p) <= 100
    assert plan_micro_batches([120], 100) == [[0]]  # a lone over-budget example still gets trained
