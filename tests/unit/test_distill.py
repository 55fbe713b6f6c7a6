"""On-policy distillation: the advantages (trainer/training/distill.py) and the teacher's logprobs of the student's
tokens, scored in the local backend by a teacher adapter loaded beside the trained one or by a teacher model of its
own; the pre-flight check of a teacher model's tokenizer and its place in the memory plan."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.helpers import FIXTURE, lora_state, make_cfg, trained_token_logprobs
from trainer.backends.local import LocalBackend, resolve_model_path
from trainer.training.batch import IntakeOptions, TrainingExample, convert_batch
from trainer.training.distill import distill_examples
from trainer.training.loss_params import LossParams
from trainer.training.losses import LossInputs, compute_loss, compute_reduction_weights
from trainer.training.schedule import adam_params


@pytest.fixture(scope="module")
def examples() -> list[TrainingExample]:
    groups = json.loads(FIXTURE.read_text())["batch"]
    return convert_batch(groups, IntakeOptions(vocab_size=2048, max_seq_len=64)).examples


def example(mask: list[float], sampler: list[float], adv: list[float]) -> TrainingExample:
    n = len(mask)
    return TrainingExample(list(range(n)), list(range(1, n + 1)), mask, sampler, adv)


def test_advantages_are_the_teacher_student_gap_plus_the_weighted_reward():
    ex = example([0.0, 1.0, 1.0, 1.0], [0.0, -1.0, -2.0, math.nan], [0.0, 0.5, 0.5, 0.5])
    (out,), metrics = distill_examples([ex], [[0.0, -0.5, -3.0, -1.0]], kl_coef=2.0, reward_coef=0.1)
    assert out.advantages == pytest.approx([0.0, 2.0 * 0.5 + 0.05, 2.0 * -1.0 + 0.05, 0.05])
    assert metrics["distill/teacher_kl"] == pytest.approx(((-1.0 + 0.5) + (-2.0 + 3.0)) / 2)
    assert metrics["distill/tokens_scored"] == 2 and metrics["distill/tokens_without_sampler_logprobs"] == 1
    assert ex.advantages == [0.0, 0.5, 0.5, 0.5]  # the input is left as it was
    with pytest.raises(ValueError, match="teacher row of 2 logprobs for a sequence of 4 targets"):
        distill_examples([ex], [[0.0, 0.0]], 1.0, 0.0)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_model_path):
    """A teacher adapter of another rank and other target modules than the student's, with random weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    torch.manual_seed(7)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(out)
    return out


def reference_logprobs(teacher_dir, examples) -> list[list[float]]:
    """The teacher by itself: PEFT's own loading of the adapter on a fresh base, one sequence at a time, float64."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"), dtype=torch.float64)
    return trained_token_logprobs(PeftModel.from_pretrained(base, str(teacher_dir)).eval(), examples)


def test_teacher_logprobs_match_the_teacher_alone_and_leave_the_student_as_it_trains(
    tmp_path, examples, teacher_dir
):
    backend = LocalBackend(make_cfg(tmp_path))
    student_before = lora_state(backend)
    backend.load_teacher(str(teacher_dir))
    got = backend.teacher_logprobs(examples)
    want = reference_logprobs(teacher_dir, examples)
    worst = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert worst < 1e-4, f"max |teacher in the trainer - teacher alone| = {worst}"
    # The student is untouched by the teacher: same trained weights, and a fresh adapter still gives the sampler's
    # (base model's) logprobs.
    assert all(torch.equal(student_before[k], v) for k, v in lora_state(backend).items())
    result = backend.forward_backward(examples, LossParams("importance_sampling"))
    assert result.metrics["importance/logprob_diff_mean"] < 1e-5
    teacher_before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if ".teacher." in n}
    assert teacher_before and not any(
        p.requires_grad for n, p in backend.model.named_parameters() if ".teacher." in n
    )
    # A distillation step moves the student only, and the teacher scores the same afterwards.
    distilled, metrics = distill_examples(examples, got, kl_coef=1.0, reward_coef=0.0)
    assert metrics["distill/teacher_kl"] > 0
    backend.train_step(distilled, LossParams("importance_sampling"), "sum", adam_params(1e-2))
    moved = lora_state(backend)
    assert any(not torch.equal(student_before[k], moved[k]) for k in student_before)
    assert all(
        torch.equal(p, teacher_before[n]) for n, p in backend.model.named_parameters() if n in teacher_before
    )
    again = backend.teacher_logprobs(examples)
    assert max(abs(a - b) for g, w in zip(again, got, strict=True) for a, b in zip(g, w, strict=True)) < 1e-6


def test_distillation_steps_bring_the_student_to_the_teacher_on_its_tokens(tmp_path, examples, teacher_dir):
    """Distillation steps on fixed sequences (their sampler logprobs updated to the student's after each step, as a
    fresh on-policy sample would carry) close the gap between the student's and the teacher's logprob of each
    token."""
    examples = examples[:4]
    backend = LocalBackend(make_cfg(tmp_path))
    backend.load_teacher(str(teacher_dir))
    teacher = backend.teacher_logprobs(examples)

    def gap(rows: list[list[float]]) -> float:
        pairs = [
            (a, b)
            for ex, r, t in zip(examples, rows, teacher, strict=True)
            for a, b, m in zip(r, t, ex.loss_mask, strict=True)
            if m
        ]
        return sum(abs(a - b) for a, b in pairs) / len(pairs)

    current, gaps = examples, [gap([ex.sampler_logprobs for ex in examples])]
    for _ in range(5):
        distilled, _ = distill_examples(current, teacher, kl_coef=1.0, reward_coef=0.0)
        backend.train_step(distilled, LossParams("importance_sampling"), "sum", adam_params(3e-3))
        now = backend.forward_backward(examples, LossParams("importance_sampling")).trainer_logprobs
        backend.model.zero_grad(set_to_none=True)
        current = [dataclasses.replace(ex, sampler_logprobs=lp) for ex, lp in zip(examples, now, strict=True)]
        gaps.append(gap(now))
    assert gaps[-1] < 0.5 * gaps[0], gaps


def test_the_teacher_is_a_peft_folder_or_a_run_folders_newest_adapter_and_local_only(tmp_path, teacher_dir):
    from trainer.training.checkpoints import adapter_dir
    from trainer.training.config import ConfigError
    from trainer.training.distill import resolve_teacher

    assert resolve_teacher(str(teacher_dir)) == str(teacher_dir)
    for v in (2, 10):
        adapter_dir(tmp_path, v).mkdir(parents=True)
    assert resolve_teacher(str(tmp_path)) == str(adapter_dir(tmp_path, 10))
    with pytest.raises(ConfigError, match=r"a folder with neither adapter_config\.json"):
        resolve_teacher(str(tmp_path / "adapters"))
    with pytest.raises(ConfigError, match="no such folder"):
        resolve_teacher(str(tmp_path / "typo"))
    assert resolve_teacher("meta-llama/Llama-3.1-70B-Instruct") == "meta-llama/Llama-3.1-70B-Instruct"
    with pytest.raises(ValueError, match="the teacher must live on Tinker"):
        make_cfg(tmp_path, distill__teacher=str(tmp_path), launch__backend="tinker")
    with pytest.raises(ValueError, match="distillation runs in one trainer process"):
        make_cfg(tmp_path, distill__teacher="x", distributed__nproc_per_node=2)


def test_a_distillation_run_trains_with_the_clipped_loss_unless_told_otherwise(tmp_path):
    plain = make_cfg(tmp_path, loss__name="importance_sampling")
    assert plain.loss_name == "importance_sampling" == plain.loss_params().name  # RL runs: loss.name as set
    cfg = make_cfg(
        tmp_path, loss__name="importance_sampling", loss__clip_high_threshold=1.5, distill__teacher="x"
    )
    assert cfg.loss_name == "ppo" and cfg.loss_params().clip_bounds() == (0.8, 1.5)  # loss.clip_* still apply
    cfg = make_cfg(tmp_path, loss__name="cispo", distill__teacher="x", distill__loss=None)
    assert cfg.loss_params().name == "cispo"
    with pytest.raises(ValueError, match=r"distill\.loss=cross_entropy ignores the advantages"):
        make_cfg(tmp_path, distill__teacher="x", distill__loss="cross_entropy")
    with pytest.raises(ValueError, match=r"loss\.tis_cap applies to ratio losses, not distill\.loss='dro'"):
        make_cfg(tmp_path, distill__teacher="x", distill__loss="dro", loss__tis_cap=2.0)


def distill_categorical(loss: LossParams, seed: int, steps: int = 40) -> list[float]:
    """Sampled reverse-KL distillation of one categorical distribution, as the toy recipe runs it: 64 sequences of
    16 tokens per step drawn from the student one version behind (max_staleness 1), advantages from
    distill_examples, the loss divided by the sequences, Adam with beta2 0.999. The logits are the parameters, at
    lr 1.0: a sampled token's logprob moves ~0.2 nats per update (the toy run's moved ~0.7). Returns KL(student ||
    teacher) after each step."""
    teacher = torch.full((32,), 1e-4, dtype=torch.float64)
    # the toy teacher's top tokens at a completion position (its run folder's newest adapter, measured)
    teacher[:4] = torch.tensor([0.45, 0.15, 0.075, 0.07])
    teacher[4:] += (1 - teacher.sum()) / 28
    logits = torch.zeros(32, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=1.0, betas=(0.9, 0.999))
    gen = torch.Generator().manual_seed(seed)
    sampler, kls = logits.detach().clone(), []
    for _ in range(steps):
        sampler_lp = torch.log_softmax(sampler, -1)
        tokens = torch.multinomial(sampler_lp.exp(), 64 * 16, replacement=True, generator=gen).view(64, 16)
        rows = [
            TrainingExample([0] * 16, t.tolist(), [1.0] * 16, sampler_lp[t].tolist(), [0.0] * 16)
            for t in tokens
        ]
        distilled, _ = distill_examples(rows, [teacher.log()[t].tolist() for t in tokens], 1.0, 0.0)
        mask = torch.ones(64, 16, dtype=torch.float64)
        inputs = LossInputs(
            trainer_logprobs_BT=torch.log_softmax(logits, -1)[tokens],
            sampler_logprobs_BT=sampler_lp[tokens],
            advantages_BT=torch.tensor([e.advantages for e in distilled], dtype=torch.float64),
            mask_BT=mask,
            reduction_weights_BT=compute_reduction_weights(mask, "seq_mean_token_sum", 64 * 16.0, 64),
        )
        sampler = logits.detach().clone()  # the next batch is sampled by the version this step starts from
        opt.zero_grad()
        compute_loss(inputs, loss)[0].backward()
        opt.step()
        student = torch.softmax(logits.detach(), -1)
        kls.append(float((student * (student.log() - teacher.log())).sum()))
    return kls


def test_a_student_sampled_one_version_behind_does_not_collapse_onto_the_teachers_top_token(tmp_path):
    """The divergence of the toy recipe's distillation under importance_sampling: the unclipped steps overshoot
    the teacher into a student that puts all its mass on the teacher's top token (KL -log 0.45 = 0.80), where the
    sampled reverse KL has no gradient left (only that token is sampled, and d log p / d logits -> 0 as p -> 1).
    The loss a distillation run trains with by default stays near the teacher."""
    stuck = math.log(1 / 0.45)
    collapsed = [distill_categorical(LossParams("importance_sampling"), seed) for seed in range(3)]
    assert sum(kls[-1] > 0.9 * stuck for kls in collapsed) >= 2, [kls[-5:] for kls in collapsed]
    default = make_cfg(tmp_path, loss__name="importance_sampling", distill__teacher="x").loss_params()
    for seed in range(3):
        kls = distill_categorical(default, seed)
        assert max(kls[-20:]) < 0.35 * stuck, (seed, kls)


def test_distillation_trains_groups_whose_rewards_are_all_equal():
    group = json.loads(FIXTURE.read_text())["batch"][0]
    same = {**group, "scores": [0.5] * len(group["scores"])}
    assert not convert_batch([same], IntakeOptions(vocab_size=2048, max_seq_len=64)).examples
    kept = convert_batch([same], IntakeOptions(vocab_size=2048, max_seq_len=64, keep_zero_variance=True))
    assert len(kept.examples) == len(group["tokens"]) and all(
        a == 0 for e in kept.examples for a in e.advantages
    )


@pytest.fixture(scope="module")
def teacher_model_dir(tmp_path_factory, teacher_dir, tiny_model_path):
    """The teacher adapter merged into a copy of the base and saved with the base's tokenizer: a model of its own
    that must score every token as the adapter does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(teacher_dir)).merge_and_unload()
    out = tmp_path_factory.mktemp("teacher-model")
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out)
    return out


def float64_logprobs(model_dir, examples) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    return trained_token_logprobs(model, examples)


def worst_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_a_teacher_model_scores_as_a_float64_forward_of_it_and_as_its_adapter_form(
    tmp_path, examples, teacher_dir, teacher_model_dir
):
    from trainer.training.distill import resolve_teacher, teacher_kind

    resolved = resolve_teacher(str(teacher_model_dir))
    assert teacher_kind(resolved) == "model" and teacher_kind(str(teacher_dir)) == "adapter"
    backend = LocalBackend(make_cfg(tmp_path))
    student_before = lora_state(backend)
    trained = [id(p) for p in backend.params]
    backend.load_teacher(resolved)
    got = backend.teacher_logprobs(examples)
    assert worst_gap(got, float64_logprobs(teacher_model_dir, examples)) < 1e-4
    assert worst_gap(got, reference_logprobs(teacher_dir, examples)) < 1e-4  # merged = adapter on the base
    # The teacher is no part of what trains: frozen, outside the optimizer, the student's adapter untouched.
    assert not any(p.requires_grad for p in backend.teacher_model.parameters())
    assert [id(p) for p in backend.params] == trained
    assert all(torch.equal(student_before[k], v) for k, v in lora_state(backend).items())
    distilled, _ = distill_examples(examples, got, kl_coef=1.0, reward_coef=0.0)
    backend.train_step(distilled, LossParams("importance_sampling"), "sum", adam_params(1e-2))
    assert any(not torch.equal(student_before[k], v) for k, v in lora_state(backend).items())
    assert worst_gap(backend.teacher_logprobs(examples), got) < 1e-6


def test_a_teacher_model_with_another_vocabulary_is_refused_when_loaded(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.training.config import ConfigError

    other = tmp_path / "other"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    ).save_pretrained(other)
    backend = LocalBackend(make_cfg(tmp_path))
    with pytest.raises(ConfigError, match="vocabulary of 100 tokens, the student 2048"):
        backend.load_teacher(str(other))


def test_preflight_refuses_a_teacher_whose_tokenizer_or_chat_template_differs(tmp_path, teacher_model_dir):
    from trainer.backends.tiny_model import ensure_tiny_model
    from trainer.orchestration.preflight import check_teacher_tokenizer

    student = resolve_model_path("tiny")
    assert check_teacher_tokenizer(student, str(teacher_model_dir)) == []
    (problem,) = check_teacher_tokenizer(student, str(ensure_tiny_model(seed=1)))  # trained on another corpus
    assert "its tokenizer differs from the student's (2048 tokens against 2048; e.g. " in problem, problem
    templated = tmp_path / "templated"
    templated.mkdir()
    for f in teacher_model_dir.iterdir():
        (templated / f.name).write_bytes(f.read_bytes())
    tok_config = json.loads((templated / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    (templated / "tokenizer_config.json").write_text(json.dumps(tok_config))
    for f in templated.glob("chat_template.*"):
        f.unlink()
    (problem,) = check_teacher_tokenizer(student, str(templated))
    assert "its chat template differs from the student's" in problem, problem


def test_the_memory_plan_counts_a_teacher_models_weights():
    from trainer.orchestration.memory_plan import build_memory_plan
    from trainer.orchestration.model_shape import ModelShape, load_model_config

    config = load_model_config("tiny")
    assert config is not None
    cfg = make_cfg("/tmp/unused", distill__teacher="tiny")
    without = build_memory_plan(cfg, config, None, None, on_cuda=False)
    plan = build_memory_plan(cfg, config, None, None, on_cuda=False, teacher_config=config)
    part = next(p for p in plan.trainer.parts if p.name.startswith("teacher model weights"))
    assert part.bytes == ModelShape.from_config(config).parameter_count() * 4  # float32 on CPU
    assert plan.trainer.total == without.trainer.total + part.bytes


def test_launch_preflight_fetches_a_teacher_model_and_refuses_another_tokenizer(tmp_path):
    from trainer.backends.tiny_model import ensure_tiny_model
    from trainer.orchestration.launcher import preflight
    from trainer.training.config import ConfigError

    cfg = make_cfg(
        tmp_path, distill__teacher="tiny"
    )  # a model named like model.path: found (or fetched) alike
    assert preflight(cfg) == cfg.distill.teacher == resolve_model_path("tiny")
    cfg = make_cfg(tmp_path, distill__teacher=str(ensure_tiny_model(seed=1)))
    with pytest.raises(ConfigError, match="its tokenizer differs from the student's"):
        preflight(cfg)
