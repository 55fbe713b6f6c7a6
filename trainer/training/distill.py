"""On-policy distillation's per-token advantages: the student samples, a teacher scores each sampled token, and the
importance-sampling loss follows

    advantage_t = kl_coef * (log p_teacher(x_t) - log p_student(x_t)) + reward_coef * (the environment's advantage)

where log p_student is the sampler's logprob of the token (the policy that sampled it: on-policy). The first term's
expectation under the student is minus the reverse KL(student || teacher) per token, so minimising the loss moves
the student towards the teacher on its own samples. Pure: no model, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trainer.training.checkpoints import VERSION_DIR
from trainer.training.config import ConfigError, is_url_teacher

if TYPE_CHECKING:  # the launcher's preflight reads the teacher helpers here without importing torch
    from trainer.training.batch import TrainingExample

TeacherKind = Literal["adapter", "model", "tinker", "url"]
TINKER_SCHEME = "tinker://"  # a sampler checkpoint on Tinker (--backend tinker)


def resolve_teacher(path: str) -> str:
    """distill.teacher as what the trainer loads: a PEFT adapter folder as given, a run folder's newest adapter, a
    server's URL as given (trainer/training/teacher_http.py), or anything else as a whole model (a folder with
    config.json, `tiny`, or a hub id the launcher fetches like model.path)."""
    if is_url_teacher(path):
        return path
    if path.startswith(TINKER_SCHEME):
        return path
    folder = Path(path).expanduser()
    if (folder / "adapter_config.json").is_file():
        return str(folder.resolve())
    versions = [
        (int(m.group(1)), p) for p in (folder / "adapters").glob("v*") if (m := VERSION_DIR.match(p.name))
    ]
    if versions:
        return str(max(versions)[1].resolve())
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ConfigError(
            f"distill.teacher={path!r} is a folder with neither adapter_config.json (a PEFT adapter), adapters/vN (a "
            "run folder) nor config.json (a model): pass a teacher run's folder, an adapter folder or a model"
        )
    if not folder.exists() and path.startswith(("/", ".", "~")):
        raise ConfigError(f"distill.teacher={path!r}: no such folder (a hub id has no leading / . or ~)")
    return path if not folder.is_dir() else str(folder.resolve())


def teacher_kind(resolved: str) -> TeacherKind:
    """What resolve_teacher's answer names: a LoRA adapter on the student's base, a model of its own (a folder or a
    hub id; with --backend tinker, a base model Tinker serves), a sampler checkpoint on Tinker, or a vLLM server's
    URL (trainer/training/teacher_http.py)."""
    if resolved.startswith(TINKER_SCHEME):
        return "tinker"
    if is_url_teacher(resolved):
        return "url"
    return "adapter" if (Path(resolved) / "adapter_config.json").is_file() else "model"


def distill_examples(
    examples: Sequence[TrainingExample],
    teacher_logprobs: Sequence[Sequence[float]],
    kl_coef: float,
    reward_coef: float,
) -> tuple[list[TrainingExample], dict[str, float]]:
    """The examples with distillation advantages, and `distill/*` metrics: `teacher_kl` (mean over trained tokens of
    log p_student - log p_teacher, a sample estimate of the per-token reverse KL), `tokens_scored`, and
    `tokens_without_sampler_logprobs` (a group sent without them keeps only its reward term)."""
    if len(teacher_logprobs) != len(examples):
        raise ValueError(f"{len(teacher_logprobs)} teacher rows for {len(examples)} examples")
    out, kl_sum, scored, missing = [], 0.0, 0, 0
    for ex, teacher in zip(examples, teacher_logprobs, strict=True):
        if len(teacher) != len(ex.target_ids):
            raise ValueError(
                f"teacher row of {len(teacher)} logprobs for a sequence of {len(ex.target_ids)} targets"
            )
        advantages = []
        for m, adv, student, t in zip(ex.loss_mask, ex.advantages, ex.sampler_logprobs, teacher, strict=True):
            if not m:
                advantages.append(0.0)
                continue
            if not math.isfinite(student) or not math.isfinite(t):
                missing += 1
                advantages.append(reward_coef * adv)
                continue
            scored += 1
            kl_sum += student - t
            advantages.append(kl_coef * (t - student) + reward_coef * adv)
        out.append(replace(ex, advantages=advantages))
    return out, {
        "distill/teacher_kl": kl_sum / scored if scored else math.nan,
        "distill/tokens_scored": float(scored),
        "distill/tokens_without_sampler_logprobs": float(missing),
    }
