"""The local PEFT backend on the offline tiny model: alignment with sampler logprobs, training moves only LoRA,
adapters reload with identical logits, resume is bit-exact, micro-batching equals one big batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import FIXTURE, lora_state, make_cfg
from trainer.backends.local import LocalBackend
from trainer.training.batch import IntakeOptions, TrainingExample, convert_batch
from trainer.training.logprobs import compute_token_logprobs
from trainer.training.loss_params import LossParams
from trainer.training.losses import BatchScale
from trainer.training.schedule import adam_params, build_adam_params


@pytest.fixture(scope="module")
def fixture_examples() -> list[TrainingExample]:
    groups = json.loads(FIXTURE.read_text())["batch"]
    return convert_batch(groups, IntakeOptions(vocab_size=2048, max_seq_len=64)).examples


def test_fresh_adapter_reproduces_sampler_logprobs(tmp_path, fixture_examples):
    """The fixture was sampled from the base model; a fresh LoRA (B = 0) must give the same logprobs."""
    backend = LocalBackend(make_cfg(tmp_path))
    result = backend.forward_backward(fixture_examples, LossParams("importance_sampling"))
    diffs = [
        abs(t - s)
        for ex, lp in zip(fixture_examples, result.trainer_logprobs, strict=False)
        for t, s, m in zip(lp, ex.sampler_logprobs, ex.loss_mask, strict=False)
        if m
    ]
    assert len(diffs) == sum(ex.num_trained for ex in fixture_examples)
    assert max(diffs) < 1e-4, f"max |trainer - sampler| = {max(diffs)}"
    assert result.metrics["importance/logprob_diff_mean"] < 1e-5
    assert result.metrics["importance/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["perf/micro_batches"] >= 2  # 12 x ~30 tokens over a 256-token budget


def test_chunked_logprobs_match_full_log_softmax():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    targets = torch.randint(0, 50, (3, 5))
    select = torch.rand(3, 5) > 0.3
    temp = torch.tensor([1.0, 0.5, 2.0])
    got = compute_token_logprobs(head, hidden, targets, select, temp, chunk_tokens=2)
    ref = torch.log_softmax(head(hidden).double() / temp[:, None, None].double(), -1).gather(
        2, targets[..., None]
    )[..., 0]
    ref = torch.where(select, ref, torch.zeros_like(ref))
    assert (got.double() - ref).abs().max() < 1e-5
    g_got = torch.autograd.grad(got.sum(), [hidden, head.weight])
    g_ref = torch.autograd.grad(ref.sum(), [hidden, head.weight])
    for a, b in zip(g_got, g_ref, strict=False):
        assert (a.double() - b).abs().max() < 1e-5


def test_sft_steps_move_only_lora_and_lower_loss(tmp_path, fixture_examples):
    backend = LocalBackend(make_cfg(tmp_path))
    frozen_before = {
        n: p.detach().clone() for n, p in backend.model.named_parameters() if not p.requires_grad
    }
    lora_before = lora_state(backend)
    assert lora_before and all("lora_" in n for n in lora_before)
    examples = fixture_examples[:4]
    losses = []
    for _ in range(5):
        fb = backend.forward_backward(examples, LossParams("cross_entropy"), "token_mean")
        losses.append(fb.loss)
        metrics = backend.optim_step(adam_params(1e-2, grad_clip_norm=1.0))
        assert metrics["optim/grad_norm"] > 0 and metrics["optim/skipped_nonfinite"] == 0
    assert losses[-1] < losses[0] - 0.5, losses
    for n, p in backend.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[n]), f"frozen parameter {n} moved"
    moved = [n for n, p in lora_state(backend).items() if not torch.equal(p, lora_before[n])]
    assert len(moved) == len(lora_before)
    assert backend.step == 5


def test_saved_adapter_reloads_in_peft_with_identical_logits(tmp_path, fixture_examples):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = LocalBackend(make_cfg(tmp_path))
    for _ in range(2):
        backend.forward_backward(fixture_examples[:4], LossParams("importance_sampling"))
        backend.optim_step(adam_params(1e-2))
    path = Path(backend.save_for_sampler(1))
    assert path.name == "v000001" and sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert not list(path.parent.glob(".*")), "temp folder left behind"
    from safetensors.torch import load_file

    saved = load_file(str(path / "adapter_model.safetensors"))
    assert all("lora_" in k for k in saved) and all(v.dtype == torch.float32 for v in saved.values())
    with pytest.raises(FileExistsError):
        backend.save_for_sampler(1)

    ids = torch.tensor([fixture_examples[0].input_ids])
    backend.model.eval()
    with torch.no_grad():
        expected = backend.model(input_ids=ids).logits
    base_path = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    reloaded = PeftModel.from_pretrained(base, str(path)).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    assert torch.equal(got, expected), f"max diff {(got - expected).abs().max()}"
    assert (plain - got).abs().max() > 1e-3, "the adapter changed nothing: training or saving is broken"


def test_resume_reproduces_next_step_bit_for_bit(tmp_path, fixture_examples):
    # LoRA dropout makes the step depend on the RNG, so the RNG state must be restored too.
    # The LR schedule (warmup) depends on the restored step count.
    cfg = make_cfg(
        tmp_path, lora__dropout=0.1, optim__lr=5e-3, optim__weight_decay=0.01, optim__warmup_steps=4
    )
    loss = LossParams("ppo")
    first = LocalBackend(cfg)
    first.forward_backward(fixture_examples, loss)
    first.optim_step(build_adam_params(first.step, cfg.optim))
    ckpt = first.save_state("step-1")
    fb_a = first.forward_backward(fixture_examples, loss)
    lr_a = first.optim_step(build_adam_params(first.step, cfg.optim))["optim/lr"]
    after_a = lora_state(first)

    torch.manual_seed(1234)  # a resumed process starts with an unrelated RNG state
    second = LocalBackend(cfg)
    second.load_state(ckpt)
    assert second.step == 1
    fb_b = second.forward_backward(fixture_examples, loss)
    lr_b = second.optim_step(build_adam_params(second.step, cfg.optim))["optim/lr"]
    assert lr_a == lr_b == 2.5e-3
    assert fb_b.loss == fb_a.loss
    after_b = lora_state(second)
    assert all(torch.equal(after_a[n], after_b[n]) for n in after_a)
    # and the weights really moved
    assert any(not torch.equal(after_a[n], p) for n, p in lora_state(LocalBackend(cfg)).items())


def test_resume_with_other_lora_config_is_refused(tmp_path, fixture_examples):
    backend = LocalBackend(make_cfg(tmp_path))
    ckpt = backend.save_state("s0")
    other = LocalBackend(make_cfg(tmp_path, lora__rank=4))
    with pytest.raises(ValueError, match="different 'lora' config"):
        other.load_state(ckpt)


def test_resume_accepts_the_same_model_folder_through_a_symlink(tmp_path, tiny_model_path):
    """A cache reached through a symlink (or moved behind one) is the same model: resume must not refuse it."""
    link = tmp_path / "models-link"
    link.symlink_to(tiny_model_path, target_is_directory=True)
    ckpt = LocalBackend(make_cfg(tmp_path / "a", model__path=str(link))).save_state("s0")
    LocalBackend(make_cfg(tmp_path / "b", model__path=str(Path(tiny_model_path).resolve()))).load_state(ckpt)


def test_micro_batching_equals_one_big_batch(tmp_path, fixture_examples):
    grads = []
    for budget in (64, 4096):
        backend = LocalBackend(make_cfg(tmp_path / str(budget), trainer__micro_batch_tokens=budget))
        fb = backend.forward_backward(fixture_examples, LossParams("grpo"), "seq_mean_token_mean")
        grads.append(
            ({n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad}, fb)
        )
    (g_small, fb_small), (g_big, fb_big) = grads
    assert fb_small.metrics["perf/micro_batches"] > fb_big.metrics["perf/micro_batches"] == 1
    assert fb_small.loss == pytest.approx(fb_big.loss, rel=1e-5, abs=1e-7)
    for n in g_big:
        assert torch.allclose(g_small[n], g_big[n], atol=1e-6, rtol=1e-4), n


def test_gradient_checkpointing_gives_same_gradients(tmp_path, fixture_examples):
    out = []
    for ckpt in (False, True):
        backend = LocalBackend(make_cfg(tmp_path / str(ckpt), model__gradient_checkpointing=ckpt))
        fb = backend.forward_backward(fixture_examples[:4], LossParams("cross_entropy"))
        out.append(
            (fb.loss, {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad})
        )
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    for n in out[0][1]:
        assert torch.allclose(out[0][1][n], out[1][1][n], atol=1e-6), n


def test_nonfinite_gradient_skips_the_update(tmp_path, fixture_examples):
    backend = LocalBackend(make_cfg(tmp_path))
    backend.forward_backward(fixture_examples[:2], LossParams("cross_entropy"))
    before = lora_state(backend)
    next(p for p in backend.params).grad[0, 0] = float("nan")
    metrics = backend.optim_step(adam_params(1e-2))
    assert metrics["optim/skipped_nonfinite"] == 1
    assert all(torch.equal(before[n], p) for n, p in lora_state(backend).items())
    assert all(p.grad is None for p in backend.params)


def test_processed_sampler_logprobs_use_the_sequence_temperature(tmp_path, fixture_examples):
    raw = LocalBackend(make_cfg(tmp_path / "raw"))
    hot = LocalBackend(make_cfg(tmp_path / "hot", advantage__sampler_logprobs="processed"))
    ex = fixture_examples[0]
    at_half = TrainingExample(**{**ex.__dict__, "temperature": 0.5})
    lp_raw = raw.forward_backward([at_half], LossParams("cross_entropy")).trainer_logprobs[0]
    lp_hot = hot.forward_backward([at_half], LossParams("cross_entropy")).trainer_logprobs[0]
    ids = torch.tensor([ex.input_ids])
    with torch.no_grad():
        logits = raw.model(input_ids=ids).logits[0].double()
    ref = torch.log_softmax(logits / 0.5, -1).gather(1, torch.tensor(ex.target_ids)[:, None])[:, 0]
    trained = [t for t, m in enumerate(ex.loss_mask) if m]
    assert max(abs(lp_hot[t] - float(ref[t])) for t in trained) < 1e-4
    assert max(abs(lp_hot[t] - lp_raw[t]) for t in trained) > 1e-2


def test_groups_without_sampler_logprobs_train_as_on_policy(tmp_path):
    """A tokenize_for_trainer environment sends no inference_logprobs: with "recompute" the trainer's own logprobs
    stand in (ratio 1), so the gradient equals that of the same groups carrying the trainer's exact logprobs."""
    groups = json.loads(FIXTURE.read_text())["batch"]
    bare = [{k: v for k, v in g.items() if k != "inference_logprobs"} for g in groups]
    opts = IntakeOptions(vocab_size=2048, max_seq_len=64, missing_sampler_logprobs="recompute")
    recomputed = convert_batch(bare, opts)
    assert recomputed.drops == [] and len(recomputed.examples) == len(convert_batch(groups, opts).examples)
    backend = LocalBackend(make_cfg(tmp_path / "a"))
    exact = backend.forward_backward(recomputed.examples, LossParams("importance_sampling"))
    g_recomputed = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    exact_examples = [
        dataclasses.replace(
            ex, sampler_logprobs=[v if m else 0.0 for v, m in zip(lp, ex.loss_mask, strict=True)]
        )
        for ex, lp in zip(recomputed.examples, exact.trainer_logprobs, strict=True)
    ]
    other = LocalBackend(make_cfg(tmp_path / "b"))
    other.forward_backward(exact_examples, LossParams("importance_sampling"))
    for n, p in other.model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, g_recomputed[n], atol=1e-7, rtol=1e-5), n
    assert any(g.abs().sum() > 0 for g in g_recomputed.values())


@pytest.mark.parametrize("reduction", ["seq_mean_token_sum", "token_mean"])
def test_untrained_sequences_in_the_batch_scale_shrink_the_mean(tmp_path, fixture_examples, reduction):
    """A batch of 12 trained sequences whose step also took 12 zero-variance ones (and their tokens) divides by 24:
    the loss and every gradient are half those of the trained sequences alone, so a step where most groups carry
    no signal does not give the rest of them the whole update."""
    backend = LocalBackend(make_cfg(tmp_path))
    own = BatchScale.of(fixture_examples)
    results = []
    for scale in (None, BatchScale(2 * own.sequences, 2 * own.tokens)):
        backend.model.zero_grad(set_to_none=True)
        fb = backend.forward_backward(fixture_examples, LossParams("ppo"), reduction, scale)
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad}
        results.append((fb.loss, grads))
    (loss_own, g_own), (loss_half, g_half) = results
    assert loss_own != 0 and loss_half == pytest.approx(loss_own / 2, rel=1e-5)
    assert any(g.abs().sum() > 0 for g in g_own.values())
    for n in g_own:
        assert torch.allclose(g_half[n], g_own[n] / 2, atol=1e-7, rtol=1e-4), n
