"""The trainer's configuration: pydantic models, YAML files and dotted CLI overrides (`optim.lr=2e-5`).

Each default is written once, here, with its unit. Loading never touches a model or the network.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from rlcommon.lora_slots import KEEP_VERSIONS_MEANING
from rlcommon.overrides import apply_overrides, error_lines, renamed_key
from rlcommon.pass_at_k import greedy_pass_at_k_problem
from rlcommon.timeouts import GATE_HOLD_S
from trainer.training.config_base import Section
from trainer.training.launch_config import (
    ENGINE_KEYS,
    EngineAttachKeys,
    LaunchConfig,
    PricingConfig,
    ServiceConfig,
    TinkerConfig,
)
from trainer.training.lora_spec import tinker_lora_flags
from trainer.training.loss_params import (
    DEFAULT_DRO_BETA,
    DEFAULT_MASK_BOUNDS,
    MASKABLE_LOSSES,
    RATIO_LOSSES,
    LossName,
    LossParams,
    RatioMask,
    Reduction,
)
from trainer.training.rollout_config import RolloutConfig


class ModelConfig(Section):
    path: str = Field(
        "tiny", description="HF hub id, local folder, or 'tiny' for the offline random test model"
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="auto = bfloat16 on CUDA, float32 on CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        False,
        description="recompute activations in backward to save memory: true = every decoder layer; auto = the "
        "fewest layers whose planned peak fits the trainer's share of the GPU (the launcher's memory plan "
        "chooses, --dry-run says why; every layer on a GPU without a plan, none on CPU)",
    )
    checkpoint_layers: int | None = Field(
        None,
        ge=0,
        description="with gradient_checkpointing auto: how many decoder layers recompute, spread evenly; the "
        "launcher's memory plan writes it; None = not chosen yet",
    )
    attn_implementation: str | None = Field(
        None, description="passed to from_pretrained (e.g. sdpa); None = HF default"
    )

    def recomputed_layers(self, layers: int, on_cuda: bool) -> int:
        """How many of `layers` decoder layers gradient checkpointing recomputes."""
        if self.gradient_checkpointing == "auto":
            if self.checkpoint_layers is not None:
                return min(self.checkpoint_layers, layers)
            return layers if on_cuda else 0
        return layers if self.gradient_checkpointing else 0


class LoraConfig(Section):
    rank: int = Field(32, ge=1, description="LoRA rank r")
    alpha: int = Field(32, gt=0, description="LoRA alpha; scale = alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt; all-linear = every linear projection except lm_head"
    )
    seed: int = Field(0, description="seed for the LoRA initialisation and trainer RNG")


class OptimConfig(Section):
    lr: float = Field(4e-5, gt=0, description="peak learning rate")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    grad_clip_norm: float = Field(1.0, ge=0, description="global grad-norm clip; 0 = no clipping")
    warmup_steps: int = Field(
        0, ge=0, description="linear warmup from 0 to lr over this many optimizer steps"
    )
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="decay after warmup")
    total_steps: int = Field(0, ge=0, description="steps for linear/cosine decay to reach 0; 0 = no decay")


class LossConfig(Section):
    name: LossName = Field("importance_sampling", description="Tinker loss name, or grpo")
    reduction: Reduction = Field("sum", description="sum = Tinker's; means divide by batch-level counts")
    clip_low_threshold: float | None = Field(
        None, description="lower ratio bound (ppo/grpo/gspo/cispo); None = Tinker's"
    )
    clip_high_threshold: float | None = Field(None, description="upper ratio bound; None = Tinker's default")
    beta: float = Field(DEFAULT_DRO_BETA, ge=0, description="dro quadratic penalty")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling cap on the ratio")
    ratio_mask: RatioMask = Field(
        "none",
        description="masking correction: token = leave out each token whose trainer/sampler ratio is outside "
        "[mask_low, mask_high]; sequence = leave out each sequence whose geometric-mean ratio is; none = off",
    )
    mask_low: float = Field(DEFAULT_MASK_BOUNDS[0], gt=0, lt=1, description="lower ratio bound of ratio_mask")
    mask_high: float = Field(DEFAULT_MASK_BOUNDS[1], gt=1, description="upper ratio bound of ratio_mask")

    def params(self) -> LossParams:
        return LossParams(
            name=self.name,
            clip_low_threshold=self.clip_low_threshold,
            clip_high_threshold=self.clip_high_threshold,
            beta=self.beta,
            tis_cap=self.tis_cap,
            ratio_mask=self.ratio_mask,
            mask_low=self.mask_low,
            mask_high=self.mask_high,
        )


class AdvantageConfig(Section):
    normalize_std: bool | None = Field(None, description="divide by group std; None = only for the grpo loss")
    std_eps: float = Field(1e-6, gt=0, description="added to the std before dividing")
    sampler_logprobs: Literal["raw", "processed"] = Field(
        "raw",
        description="raw: sampler logprobs are pre-temperature (vLLM default); processed: post-temperature",
    )


class TrainerConfig(Section):
    max_seq_len: int = Field(
        2048, ge=2, description="longest prompt+completion the trainer trains, tokens (see overlong)"
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate",
        description="a sequence longer than max_seq_len: train its first max_seq_len tokens, or drop it "
        "(its group's other sequences train either way; rollouts/sequences_truncated counts them)",
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="tokens one forward/backward micro-batch computes (packed: each sequence's own tokens, a "
        "shared prefix once; padded: sequences x the longest)",
    )
    micro_batch_layout: Literal["packed", "padded"] = Field(
        "packed",
        description="packed: sequences end to end with no padding, each attending only to itself and a shared "
        "prefix computed once; padded: right-padded rows (the reference the packed path is tested against)",
    )
    shared_prefix_min_tokens: int = Field(
        16,
        ge=0,
        description="packed layout: sequences whose first input tokens agree for at least this many tokens (a "
        "group's prompt) compute that prefix once; 0 = never share",
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="tokens per lm_head chunk (bounds fp32 logits memory)"
    )
    save_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="adapter dtype for the sampler; auto = bfloat16 on CUDA, float32 on CPU"
    )
    output_dir: str = Field(
        "runs/default",
        description="run folder: adapters/, checkpoints/, metrics.jsonl; launch.sh appends -<date>-<time> to a "
        "recipe file's value (runs/<env> when the file sets none) and takes one given on the command line as it is",
    )
    checkpoint_every: int = Field(
        10, ge=0, description="save optimizer+adapter state every N steps; 0 = never"
    )
    batch_poll_s: float = Field(0.1, gt=0, description="pause between run-api GET /batch polls, seconds")
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads when training on CPU; None = torch's default (all cores). With vLLM "
        "on the same cores, 1 avoids fighting its OpenMP workers",
    )
    retry_budget_s: float = Field(
        300.0,
        ge=1,
        description="how long a call to run-api or the gateway keeps retrying transient failures (connection "
        "errors, timeouts, 502/503/504) before the trainer gives up and names the component",
    )
    request_timeout_s: float = Field(
        30.0, gt=0, description="per-attempt timeout of the trainer's calls to run-api and gateway lookups"
    )


class PublishConfig(Section):
    """How each new adapter reaches the sampler: the on-policy gate around it, its overlap with the next batch's
    wait, and the check that the served adapter is the trained one."""

    gate: Literal["auto", "on", "off"] = Field(
        "auto",
        description="hold new generation requests from taking a batch until its update is published, so they "
        "sample the new version; auto = on when rollout.max_staleness is 0",
    )
    gate_hold_s: float = Field(
        GATE_HOLD_S,
        gt=0,
        le=3600,
        description="the longest the gateway holds a request for the next version (then it serves the current "
        "one); well under Atropos's client timeouts",
    )
    gate_quota: bool = Field(
        True,
        description="with the gate: once a batch's worth of sequences has started on a version, hold further "
        "requests for the next one (environments start the next batch before the trainer takes this one); in a "
        "mixed run, each environment's share of the batch, also without the gate at max_staleness 1",
    )
    gate_refill_s: float = Field(
        1.0,
        gt=0,
        le=600,
        description="requests held over the quota go through on the current version once nothing has run for "
        "this long and no batch was taken (an environment that discarded groups needs more than a batch); in a "
        "mixed run the trainer then names the environments short of their share. Raise it above the longest pause "
        "between two turns of a multi-turn environment (a slow tool call)",
    )
    overlap: bool = Field(
        True,
        description="save and load the adapter while waiting for the next batch, where the staleness bound "
        "allows (max_staleness >= 1, or the gate on); the next batch's versions are read after it lands",
    )
    verify: bool = Field(
        True,
        description="after loading each adapter, the gateway has vLLM sample one token per fixed probe prompt "
        "on it and compares the top-20 logprobs with the trainer's before serving it (local backend)",
    )
    verify_tolerance: float | None = Field(
        None,
        gt=0,
        description="float32 end to end (model, adapter, vLLM): the largest |vLLM - trainer| logprob accepted; "
        "with any bfloat16: the floor of the tolerance on the mean difference, which the gateway calibrates on the "
        "base model; None = 1e-3 and 0.02",
    )
    verify_prompts: int = Field(
        4, ge=1, le=16, description="fixed probe prompts; the top-20 next-token logprobs of each are compared"
    )
    verify_retries: int = Field(
        2,
        ge=0,
        description="publishes retried (the adapter written again) after a failed verification; past them the "
        "run stops for a person to look (exit code 3, not restarted); 0 = stop at the first failure",
    )

    @field_validator("gate", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare on/off (publish.gate=on) as a boolean.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    def gate_on(self, max_staleness: int) -> bool:
        return self.gate == "on" or (self.gate == "auto" and max_staleness == 0)


class DistributedConfig(Section):
    """Data-parallel training: torchrun starts the ranks, DDP sums LoRA gradients across them. The frozen base is
    replicated on every rank (LoRA's optimizer state is tiny, so sharding it with FSDP would buy nothing)."""

    nproc_per_node: int = Field(
        1, ge=1, description="trainer ranks per node (one per GPU); >1 starts torchrun"
    )
    nnodes: int = Field(
        1, ge=1, description="nodes the trainer spans (under SLURM: the first nnodes of the job)"
    )
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto = nccl on CUDA, gloo on CPU")
    devices: str | None = Field(
        None,
        description="CUDA_VISIBLE_DEVICES for the trainer (e.g. '2,3' when vLLM has '0,1'); None = inherit",
    )

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def is_url_teacher(teacher: str) -> bool:
    """distill.teacher names a server (trainer/training/teacher_http.py) rather than weights the trainer loads."""
    return teacher.startswith(("http://", "https://"))


# A URL teacher's token when distill.teacher_api_key is not set.
TEACHER_API_KEY_ENV = "DISTILL_TEACHER_API_KEY"


class DistillConfig(Section):
    """On-policy distillation (trainer/training/distill.py): a teacher scores the student's sampled tokens."""

    teacher: str | None = Field(
        None,
        description="what to distill from: a LoRA adapter on model.path (a PEFT folder, or a run folder: its newest "
        "adapter), a model of its own sharing the student's tokenizer (a folder or a hub id, fetched like "
        "model.path), or the http(s):// URL of a running vLLM OpenAI-compatible server; None = no distillation",
    )
    teacher_model: str | None = Field(
        None,
        description="a URL teacher's served model name; None = the server's only (base) model",
    )
    teacher_api_key: str | None = Field(
        None,
        description="a URL teacher's bearer token (never printed); None = $DISTILL_TEACHER_API_KEY, or none",
    )
    teacher_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a URL teacher's per-request timeout, seconds (retried within trainer.retry_budget_s)",
    )
    teacher_batch_tokens: int = Field(
        65536, ge=1, description="a URL teacher's request size: sequences x longest, in tokens, per request"
    )
    kl_coef: float = Field(
        1.0, gt=0, description="weight of the teacher term: kl_coef x (teacher - sampler logprob)"
    )
    reward_coef: float = Field(
        0.0, ge=0, description="weight of the environment's advantage beside it; 0 = pure distillation"
    )
    # Why not loss.name's importance_sampling: from a sampler one version behind (max_staleness >= 1) its unclipped
    # steps overshoot the teacher into a one-token student, where the sampled reverse KL has no gradient left to
    # come back (docs/training.md, "On-policy distillation"). PPO's clip drops the tokens the last update already
    # moved the advantage's way; with an on-policy sampler (ratio 1) it is the same loss.
    loss: LossName | None = Field(
        "ppo",
        description="the loss a distillation run trains with, in place of loss.name (loss.clip_*, loss.tis_cap "
        "and loss.reduction apply); None = loss.name",
    )

    @property
    def on(self) -> bool:
        return self.teacher is not None

    @property
    def by_url(self) -> bool:
        """The teacher is a server (trainer/training/teacher_http.py), not weights the trainer loads."""
        return self.teacher is not None and is_url_teacher(self.teacher)

    @model_validator(mode="after")
    def _loss_reads_advantages(self) -> DistillConfig:
        if self.loss == "cross_entropy":
            raise ValueError(
                "distill.loss=cross_entropy ignores the advantages that carry the teacher's logprobs: use ppo (the "
                "default) or another loss that reads advantages, e.g. importance_sampling"
            )
        return self

    @model_validator(mode="after")
    def _url_keys_need_a_url(self) -> DistillConfig:
        if not self.by_url and (self.teacher_model is not None or self.teacher_api_key is not None):
            raise ValueError(
                "distill.teacher_model and distill.teacher_api_key apply to a teacher behind a URL "
                f"(distill.teacher: http(s)://HOST:PORT), not distill.teacher={self.teacher!r}"
            )
        return self

    def api_key(self) -> str | None:
        """A URL teacher's bearer token: teacher_api_key, else $DISTILL_TEACHER_API_KEY, else none."""
        return self.teacher_api_key or os.environ.get(TEACHER_API_KEY_ENV) or None


class EvalConfig(Section):
    """Held-out evaluation while training: the environment's own evaluate() in a process of its own, sampling the
    policy of one step through the gateway's /eval/<target>/ routes (no on-policy gate, quota or ledger)."""

    every_steps: int = Field(0, ge=0, description="evaluate every N optimizer steps; 0 = no evaluation")
    at_start: bool = Field(True, description="also evaluate the base model before the first step")
    at_end: bool = Field(True, description="also evaluate the final policy after the last step")
    max_items: int = Field(
        0, ge=0, description="eval items per evaluation; 0 = the environment's whole eval set"
    )
    k: int = Field(1, ge=1, description="samples per item: pass@1 and, when > 1, pass@k (unbiased estimator)")
    temperature: float = Field(
        0.0, ge=0, description="eval sampling temperature; 0 = greedy (then k must be 1)"
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="completion limit in eval; None = rollout.max_new_tokens"
    )
    timeout_s: float = Field(
        1800.0, gt=0, description="an evaluation running longer is stopped and recorded as failed, seconds"
    )

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        problem = greedy_pass_at_k_problem(self.k, self.temperature, "eval.k", "eval.temperature")
        if problem:
            raise ValueError(problem)
        return self

    @property
    def on(self) -> bool:
        return self.every_steps > 0


class RunConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    inference: dict[str, Any] = Field(
        default_factory=dict,
        description="the gateway's own section: launch.sh completes it, validates it with the "
        "gateway's model (python -m inference.config) and writes it to RUN_DIR/gateway.yaml",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)
    tinker: TinkerConfig = Field(default_factory=TinkerConfig)
    pricing: PricingConfig = Field(default_factory=PricingConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        # The gateway must keep every version the trainer may still accept loaded (the launcher fills the default).
        old = renamed_key({"inference": self.inference}, RENAMED_KEYS)
        if old is not None:
            raise ValueError(renamed_message(old))
        kept = self.inference.get("keep_versions")
        if isinstance(kept, int) and kept < self.rollout.max_staleness:
            raise ValueError(
                f"inference.keep_versions={kept} is below rollout.max_staleness={self.rollout.max_staleness}: the "
                "gateway would unload versions the trainer still accepts; drop it (it follows rollout.max_staleness)"
            )
        EngineAttachKeys.model_validate({k: self.inference[k] for k in ENGINE_KEYS if k in self.inference})
        for key in ("sampler", "tinker"):
            if key in self.inference:
                raise ValueError(
                    f"inference.{key} is set by the launcher from launch.backend and the tinker: "
                    "section; remove it from the config"
                )
        if self.rollout.refill_zero_variance and self.distill.on:
            raise ValueError(
                "rollout.refill_zero_variance=true with distill: distillation trains equal-reward groups too "
                "(the teacher's signal does not need a spread of rewards); set rollout.refill_zero_variance=false"
            )
        if self.loss.tis_cap is not None and self.loss_name not in RATIO_LOSSES:
            key = "distill.loss" if self.loss_name != self.loss.name else "loss.name"
            raise ValueError(f"loss.tis_cap applies to ratio losses, not {key}={self.loss_name!r}")
        if self.launch.backend == "tinker":
            tinker_lora_flags(self.lora)  # LoraMismatch (a ValueError): what Tinker's LoRA cannot express
        if self.loss.ratio_mask != "none" and self.loss_name not in MASKABLE_LOSSES:
            key = "distill.loss" if self.loss_name != self.loss.name else "loss.name"
            raise ValueError(
                f"loss.ratio_mask applies to the losses that weigh tokens by the ratio ({', '.join(sorted(MASKABLE_LOSSES))}), "
                f"not {key}={self.loss_name!r}; set loss.ratio_mask=none"
            )
        if self.distill.teacher is not None and self.launch.backend == "tinker":
            where = Path(self.distill.teacher).expanduser()
            if where.exists() or self.distill.teacher.startswith(("/", ".", "~", "http://", "https://")):
                raise ValueError(
                    f"distill.teacher={self.distill.teacher!r} with launch.backend=tinker: the teacher must live on "
                    "Tinker, as a sampler checkpoint (tinker://...) or a base model Tinker serves; a local teacher "
                    "needs launch.backend=local"
                )
        if self.distill.on and self.distributed.world_size > 1:
            raise ValueError(
                f"distill.teacher with {self.distributed.world_size} data-parallel ranks: distillation runs in one "
                "trainer process for now; set distributed.nproc_per_node=1 and distributed.nnodes=1"
            )
        if self.distributed.world_size > 1 and self.launch.backend == "tinker":
            raise ValueError(
                f"distributed.nproc_per_node x nnodes = {self.distributed.world_size}: Tinker trains "
                "remotely; data-parallel ranks apply to launch.backend=local only"
            )
        if self.trainer.micro_batch_tokens < self.trainer.max_seq_len:
            raise ValueError(
                f"trainer.micro_batch_tokens={self.trainer.micro_batch_tokens} is below "
                f"trainer.max_seq_len={self.trainer.max_seq_len}: one sequence must fit in a micro-batch"
            )
        return self

    @property
    def loss_name(self) -> LossName:
        """The loss the run trains with: distill.loss in a distillation run (unless None), else loss.name."""
        if self.distill.on and self.distill.loss is not None:
            return self.distill.loss
        return self.loss.name

    def loss_params(self) -> LossParams:
        return replace(self.loss.params(), name=self.loss_name)

    def share_quota(self) -> bool:
        """Whether the gateway holds each environment to its share of a batch per version (publish.gate_quota):
        with the on-policy gate, and in a mixed run at max_staleness 1 without it. There atroposlib's pacing starts
        one group per environment beyond its share, which run-api hands out a batch later, two versions old: stale
        at every step. Held for the next version instead, it is trained at lag 1 (docs/environments.md)."""
        staleness = self.rollout.max_staleness
        mixed_lag_one = bool(self.rollout.envs) and staleness == 1
        return self.publish.gate_quota and (self.publish.gate_on(staleness) or mixed_lag_one)

    def runapi_batches(self) -> int:
        """The batches run-api is told the run takes (its num_steps): the environments stop sampling once it has
        handed out that many. With rollout.refill_zero_variance a step may take more than one: each replaced group
        comes out of a further batch, so at most ceil(refill_max_groups / groups_per_step) more per step."""
        r = self.rollout
        if not r.refill_zero_variance:
            return r.num_steps
        replaced = r.refill_max_groups or r.groups_per_step
        return r.num_steps * (1 + -(-replaced // r.groups_per_step))

    def env_batches_offpolicy(self) -> int:
        """atroposlib's cap on each environment's queued + in-flight rollouts, in batches (which bounds their lag
        in versions): rollout.max_batches_offpolicy, or its default. With min_batch_allocation (a mixed run) each
        environment keeps one group more queued, a batch older: one version of the staleness window goes to it
        (under the share quota too: a cap of 2 there let a version-old backlog form, benchmarks/RESULTS.md)."""
        r = self.rollout
        return r.max_batches_offpolicy or max(1, r.max_staleness - (1 if r.envs else 0))

    def normalize_std(self) -> bool:
        if self.advantage.normalize_std is None:
            return self.loss_name == "grpo"
        return self.advantage.normalize_std


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key, the value and the fix."""


C = TypeVar("C", bound=BaseModel)
# Keys that were renamed, old -> (new, what it means): the old name is refused with the new one.
RENAMED_KEYS = {
    "inference.max_staleness": (
        "inference.keep_versions",
        f"{KEEP_VERSIONS_MEANING}; unset, it follows rollout.max_staleness",
    ),
}


def renamed_message(old: str, where: str = "") -> str:
    new, meaning = RENAMED_KEYS[old]
    return f"{old}{where} is now {new} ({meaning}): rename it, or drop it"


def refuse_renamed(data: dict[str, Any], where: str) -> None:
    old = renamed_key(data, RENAMED_KEYS)
    if old is not None:
        raise ConfigError(renamed_message(old, where))


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | None = None) -> C:
    """Read YAML (optional), apply dotted overrides, validate; errors name the dotted key and the value seen."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    where = f" in {path}" if path else ""
    refuse_renamed(data, where)
    data = apply_overrides(data, overrides or [], "optim.lr=2e-5", ConfigError)
    refuse_renamed(data, " (on the command line)")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid config{where}:\n" + "\n".join(error_lines(exc.errors()))) from None


def sampler_dtype(cfg: RunConfig, cuda: bool) -> str:
    """vLLM's --dtype for this run: inference.vllm.dtype, where 'auto' (or unset) follows the trainer's own rule
    (bfloat16 on CUDA, model.dtype on CPU with float32 for its 'auto'), so both sides compute alike. vLLM's own
    'auto' would turn a float32 checkpoint into bfloat16 even on CPU. float32 on CUDA is refused: vLLM's CUDA LoRA
    kernels take only float16/bfloat16 inputs and adapters."""
    stated = str((cfg.inference.get("vllm") or {}).get("dtype", "auto"))
    if stated == "auto":
        return "bfloat16" if cuda else ("float32" if cfg.model.dtype == "auto" else cfg.model.dtype)
    if cuda and stated in ("float32", "float", "fp32"):
        raise ConfigError(
            f"inference.vllm.dtype={stated}: vLLM's CUDA LoRA kernels take only float16/bfloat16 inputs and "
            "adapters; set inference.vllm.dtype=bfloat16 (or auto: bfloat16 on CUDA, float32 on CPU)"
        )
    return stated
