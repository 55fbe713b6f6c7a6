"""Packed micro-batches (trainer/training/packing.py, trainer/backends/packed_forward.py): the plan covers every
sequence once within its budgets, and the packed forward (no padding, a shared prefix computed once) gives the
padded reference's per-token logprobs (1e-5) and LoRA gradients (1e-4 relative) in fp32."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.backends.local import LocalBackend
from trainer.training.batch import TrainingExample
from trainer.training.config import RunConfig
from trainer.training.loss_params import LossParams
from trainer.training.packing import (
    KEYS_PER_TOKEN,
    Tree,
    build_layout,
    find_trees,
    plan_packed_micro_batches,
)

# --- the plan -------------------------------------------------------------------------------------------------


def test_sequences_that_share_a_prompt_form_one_tree_and_the_others_stay_alone():
    a = [1, 2, 3, 4, 5, 6]
    seqs = [[*a, 7, 8], [9, 9, 9], [*a, 10], [*a, 7, 11, 12], [9, 9, 8]]
    trees = find_trees(seqs, min_prefix=4)
    assert {frozenset(t.members): t.prefix_len for t in trees} == {
        frozenset({0, 2, 3}): 6,
        frozenset({1}): 0,
        frozenset({4}): 0,
    }
    shared = next(t for t in trees if len(t.members) == 3)
    assert shared.prefix_len == 6  # [7] is common to two of them only: the tree keeps what all three share
    # Two sequences agreeing on [9, 9] only: under min_prefix, so not shared.
    assert all(t.prefix_len == 0 for t in trees if len(t.members) == 1)
    assert all(t.prefix_len == 0 for t in find_trees(seqs, min_prefix=0))


def test_a_newcomer_never_shortens_what_a_tree_shares():
    p = list(range(1, 21))
    seqs = [[*p, 30], [*p, 31], [*p[:5], 40, 41]]  # the third shares only 5 tokens
    trees = find_trees(seqs, min_prefix=4)
    shared = [t for t in trees if len(t.members) > 1]
    assert len(shared) == 1 and shared[0].prefix_len == 20 and set(shared[0].members) == {0, 1}


def random_batch(rng: random.Random, groups: int, vocab: int) -> list[list[int]]:
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 60))]
        for _ in range(rng.randint(1, 9)):
            out.append(prompt + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 50))])
    return out


@pytest.mark.parametrize("seed", range(20))
def test_every_sequence_is_planned_once_within_the_budgets(seed):
    rng = random.Random(seed)
    seqs = [s for s in random_batch(rng, rng.randint(1, 8), 50) if s]
    budget = rng.choice([60, 128, 400])
    plans = plan_packed_micro_batches(seqs, budget, min_prefix=rng.choice([0, 4, 16]))
    lengths = [len(s) for s in seqs]
    seen = sorted(i for trees in plans for t in trees for i in t.members)
    assert seen == list(range(len(seqs)))
    for trees in plans:
        layout = build_layout(seqs, trees)
        over = [t for t in trees if len(t.members) == 1 and lengths[t.members[0]] > budget]
        if not over:  # a sequence over the budget is a micro-batch of its own
            assert layout.computed_tokens <= budget
            assert sum(t.keys(lengths) for t in trees) <= KEYS_PER_TOKEN * budget
        else:
            assert len(trees) == 1
        # Every member's rows reproduce its tokens at its positions.
        for k, i in enumerate(layout.members):
            assert [layout.tokens[r] for r in layout.rows[k]] == seqs[i]
            assert [layout.positions[r] for r in layout.rows[k]] == list(range(len(seqs[i])))


def test_a_tree_over_the_budget_is_split_and_each_piece_computes_the_prefix():
    prompt = list(range(3, 43))  # 40 tokens
    seqs = [prompt + [50 + i] * 20 for i in range(10)]  # 10 x 60 tokens, tails of 20
    plans = plan_packed_micro_batches(seqs, token_budget=140, min_prefix=8)
    trees = [t for p in plans for t in p]
    assert all(t.prefix_len == 40 for t in trees if len(t.members) > 1)
    assert all(t.cost([60] * 10) <= 140 for t in trees)
    assert sum(len(t.members) for t in trees) == 10
    computed = sum(build_layout(seqs, p).computed_tokens for p in plans)
    assert computed < 0.7 * 600  # the prompt is computed once per piece, not once per sequence


def test_identical_sequences_are_served_entirely_by_the_prefix():
    seqs = [[5, 6, 7, 8, 9]] * 3
    (trees,) = plan_packed_micro_batches(seqs, 100, min_prefix=2)
    layout = build_layout(seqs, trees)
    assert layout.computed_tokens == 5 and all(r == [0, 1, 2, 3, 4] for r in layout.rows)


def test_a_chain_of_ever_longer_shared_prefixes_is_planned_without_deep_recursion():
    seqs = [[*range(1, 20 + k), 9999] for k in range(3000)]  # each extends the one before
    plans = plan_packed_micro_batches(seqs, 100_000, min_prefix=4)
    assert sorted(i for p in plans for t in p for i in t.members) == list(range(3000))


def test_no_sequences_plan_no_micro_batch():
    # A data-parallel rank with fewer examples than ranks plans nothing (and trains a zero-weight placeholder).
    assert find_trees([], min_prefix=16) == [] and plan_packed_micro_batches([], 256, 16) == []


def test_tree_costs_count_the_prefix_once():
    t = Tree((0, 1, 2), prefix_len=10)
    assert t.cost([30, 20, 15]) == 10 + 20 + 10 + 5
    assert t.keys([30, 20, 15]) == 10 + 65


# --- the packed forward against the padded reference ------------------------------------------------------------


def llama_model(shape: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dims = {
        "llama-4-layers": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=16),
        "mha-2-layers": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, head_dim=16),
    }[shape]  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, tie_word_embeddings=False, **dims)).float()


def make_backend(tmp_path: Path, model: Any = None, **trainer: Any) -> LocalBackend:
    cfg = RunConfig.model_validate(
        {
            "model": {"path": "tiny", "device": "cpu", "dtype": "float32"},
            "lora": {
                "rank": 8,
                "alpha": 16,
                "target_modules": [
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                    "lm_head",
                ],
            },
            "trainer": {
                "output_dir": str(tmp_path),
                "max_seq_len": 256,
                "micro_batch_tokens": 256,
                **trainer,
            },
        }
    )
    backend = LocalBackend(cfg, model=model)
    g = torch.Generator().manual_seed(3)
    for p in backend.params:  # a trained-looking adapter: B non-zero, so every LoRA path carries gradient
        p.data = torch.randn(p.shape, generator=g) * 0.05
    return backend


def ragged_examples(rng: random.Random, vocab: int, multi_turn: bool) -> list[TrainingExample]:
    """Groups of different sizes sharing their prompts; completions of ragged lengths; with multi_turn, each
    completion has an environment turn in the middle (loss mask 0) followed by a second reply."""
    out = []
    for gi, size in enumerate([1, 3, 5, 2, 7]):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(17, 50))]
        for si in range(size):
            reply = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
            mask = [0.0] * (len(prompt) - 1) + [1.0] * len(reply)
            if multi_turn:
                env = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))]
                second = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
                reply = reply + env + second
                mask = mask + [0.0] * len(env) + [1.0] * len(second)
            tokens = prompt + reply
            len(tokens) - 1
            out.append(
                TrainingExample(
                    input_ids=tokens[:-1],
                    target_ids=tokens[1:],
                    loss_mask=mask,
                    sampler_logprobs=[rng.uniform(-8, -1) * m for m in mask],
                    advantages=[rng.uniform(-1, 1) * m for m in mask],
                    temperature=rng.choice([1.0, 0.7]),
                    group_index=gi,
                    sequence_index=si,
                )
            )
    long_one = [rng.randrange(3, vocab) for _ in range(300)]  # over the 256-token budget: a micro-batch alone
    out.append(TrainingExample(long_one[:-1], long_one[1:], [1.0] * 299, [-5.0] * 299, [0.3] * 299))
    assert all(len(e) == len(e.loss_mask) for e in out) and len(out[-1]) > 256
    return out


def step(
    backend: LocalBackend, layout: str, examples: list[TrainingExample]
) -> tuple[list[list[float]], dict]:
    backend.cfg.trainer.micro_batch_layout = layout
    backend.optimizer.zero_grad(set_to_none=True)
    result = backend.forward_backward(examples, LossParams("ppo"))
    grads = {id(p): p.grad.detach().clone() for p in backend.params}
    return result.trainer_logprobs, {"grads": grads, "metrics": result.metrics, "loss": result.loss}


def assert_same(packed: tuple, padded: tuple) -> None:
    (lp_a, a), (lp_b, b) = packed, padded
    worst = max(abs(x - y) for ra, rb in zip(lp_a, lp_b, strict=True) for x, y in zip(ra, rb, strict=True))
    assert worst < 1e-5, f"max |packed - padded| logprob = {worst}"
    rel = max(float((a["grads"][k] - b["grads"][k]).norm() / b["grads"][k].norm()) for k in b["grads"])
    assert rel < 1e-4, f"largest relative LoRA gradient difference {rel}"
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"]))


@pytest.mark.parametrize("model", ["tiny", "llama-4-layers", "mha-2-layers"])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_packed_logprobs_and_gradients_equal_the_padded_reference(tmp_path, model, multi_turn):
    backend = make_backend(tmp_path, None if model == "tiny" else llama_model(model))
    examples = ragged_examples(
        random.Random(hash((model, multi_turn)) % 1000), backend.vocab_size, multi_turn
    )
    packed = step(backend, "packed", examples)
    padded = step(backend, "padded", examples)
    assert_same(packed, padded)
    # The prompts were computed once per group: far fewer tokens than the padded layout, fewer than the real ones.
    m_packed, m_padded = packed[1]["metrics"], padded[1]["metrics"]
    assert m_packed["tokens/forward"] == m_padded["tokens/forward"] == sum(len(e) for e in examples)
    assert m_packed["tokens/forward_computed"] < 0.8 * m_packed["tokens/forward"]
    assert m_padded["tokens/forward_computed"] > m_padded["tokens/forward"]


def test_packing_without_sharing_computes_exactly_the_real_tokens(tmp_path):
    backend = make_backend(tmp_path, shared_prefix_min_tokens=0)
    examples = ragged_examples(random.Random(5), backend.vocab_size, multi_turn=False)
    packed = step(backend, "packed", examples)
    assert packed[1]["metrics"]["tokens/forward_computed"] == packed[1]["metrics"]["tokens/forward"]
    assert_same(packed, step(backend, "padded", examples))


def test_gradient_checkpointing_and_the_packed_forward_agree_with_the_reference(tmp_path):
    backend = make_backend(tmp_path, llama_model("llama-4-layers"))
    backend.model.get_base_model().gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    examples = ragged_examples(random.Random(9), backend.vocab_size, multi_turn=True)
    assert_same(step(backend, "packed", examples), step(backend, "padded", examples))


def test_teacher_logprobs_of_a_distillation_batch_are_the_same_packed_and_padded(tmp_path, tiny_model_path):
    backend = make_backend(tmp_path)
    backend.load_teacher(str(tiny_model_path))  # a model of its own, packed attention enabled on it too
    examples = ragged_examples(random.Random(11), backend.vocab_size, multi_turn=True)
    backend.cfg.trainer.micro_batch_layout = "packed"
    packed = backend.teacher_logprobs(examples)
    backend.cfg.trainer.micro_batch_layout = "padded"
    padded = backend.teacher_logprobs(examples)
    worst = max(abs(x - y) for a, b in zip(packed, padded, strict=True) for x, y in zip(a, b, strict=True))
    assert worst < 1e-5
    # ... and they go through the packed training step unchanged (the distillation loss reads them per token).
    from trainer.training.distill import distill_examples

    distilled, _ = distill_examples(examples, packed, kl_coef=1.0, reward_coef=0.0)
    assert_same(step(backend, "packed", distilled), step(backend, "padded", distilled))


def test_the_service_trains_datums_that_share_a_prefix_as_the_padded_reference(tmp_path):
    from trainer.service.policies import LoraSpec, MultiLora

    cfg = make_backend(tmp_path).cfg
    multi = MultiLora(cfg)
    multi.create("a", LoraSpec(rank=8, seed=1, train_mlp=True, train_attn=True, train_unembed=True))
    for p in multi.clients["a"].params.values():
        p.data = torch.randn(p.shape) * 0.05
    examples = ragged_examples(random.Random(13), multi.vocab_size, multi_turn=False)[:-1]
    out = {}
    for layout in ("packed", "padded"):
        multi.cfg.trainer.micro_batch_layout = layout
        for p in multi.clients["a"].params.values():
            p.grad = None
        lps, loss, _ = multi.forward_backward("a", examples, LossParams("importance_sampling"), backward=True)
        out[layout] = (lps, loss, {k: p.grad.clone() for k, p in multi.clients["a"].params.items()})
    (lp_a, loss_a, g_a), (lp_b, loss_b, g_b) = out["packed"], out["padded"]
    assert max(float(abs(x - y).max()) for x, y in zip(lp_a, lp_b, strict=True)) < 1e-5
    assert abs(loss_a - loss_b) <= 1e-5 * max(1.0, abs(loss_b))
    assert max(float((g_a[k] - g_b[k]).norm() / g_b[k].norm()) for k in g_b) < 1e-4
