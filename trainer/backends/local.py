"""The local training backend: a Hugging Face causal LM with a PEFT LoRA adapter, trained in this process.

Owns the model, optimizer and RNG; computes losses with trainer.training.losses; writes adapters vLLM can hot-load.
Must not talk to run-api or the gateway (the loop does).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.backends import cuda_check, micro_batches
from trainer.backends.checkpointing import apply_gradient_checkpointing
from trainer.backends.collectives import (
    gather_objects,
    init_process_group,
    rank_info,
    shard_indices,
    wrap_data_parallel,
)
from trainer.backends.expert_lora import per_expert_layout
from trainer.backends.micro_batches import MicroBatch, causal_lm_logprobs
from trainer.backends.packed_forward import enable_packed_attention
from trainer.backends.run_state import atomic_dir, rng_state, seed_everything, set_rng_state
from trainer.training.backend import AdamParams, ForwardBackwardResult
from trainer.training.batch import TrainingExample, examples_to_tensors
from trainer.training.checkpoints import failpoint
from trainer.training.config import ConfigError, RunConfig
from trainer.training.distill import teacher_kind
from trainer.training.logprobs import top_logprobs
from trainer.training.loss_params import LossParams, Reduction
from trainer.training.losses import (
    BatchScale,
    LossInputs,
    compute_loss,
    compute_reduction_weights,
    finalize_metrics,
)
from trainer.training.teacher_http import UrlTeacher

ADAPTER_FILE = "adapter_model.safetensors"
STUDENT, TEACHER = "default", "teacher"  # PEFT adapter names: the one trained, and a distillation teacher
log = logging.getLogger("trainer.backend")


def resolve_device(cfg: RunConfig, dev_dir: Path = Path("/dev")) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK under torchrun on GPUs. `auto` means the CPU only on a machine
    without NVIDIA GPU device files (in dev_dir): with GPUs there but CUDA unusable, it is an error naming why,
    not an 8B model trained on the CPU without a word."""
    if cfg.model.device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", rank_info().local_rank)
    gpus = [str(dev_dir / name) for name in cuda_check.nvidia_device_files(dev_dir)]
    if cfg.model.device == "auto" and not gpus:
        return torch.device("cpu")
    why = cuda_check.diagnose(cuda_check.read_state()) or "torch.cuda.is_available() is False"
    where = f"on a machine with NVIDIA GPUs ({', '.join(gpus)})" if gpus else "on this machine"
    raise RuntimeError(
        f"model.device={cfg.model.device} {where}, but CUDA is not usable: {why}. Fix that, or set "
        "model.device=cpu to train on the CPU on purpose"
    )


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def use_tf32_on_cuda(device: torch.device) -> bool:
    """Let fp32 matmuls on CUDA run on TF32 tensor cores; True when it did. The LoRA weights are fp32 masters (see
    build_peft_model), so every LoRA matmul (x @ A, then @ B) and its backward is an fp32 matmul that otherwise runs
    at full fp32 speed, several times slower than TF32 on Ampere and later. TF32 keeps fp32's range and rounds
    the inputs to a 10-bit mantissa, still finer than the bf16 base those activations come from. CUDA's own
    switches only: torch.set_float32_matmul_precision("high") would also move oneDNN's CPU matmuls off fp32, and
    the CPU recipes compare logprobs with vLLM to 1e-5."""
    if device.type != "cuda":
        return False
    # cuBLAS only: cuDNN convolutions already default to TF32 (and a decoder LM has none).
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        # torch >= 2.9's setting. Mixing it with the legacy allow_tf32 flag makes torch raise when either is read
        # (transformers and inductor read the new one), so the legacy flag is set only where this does not exist.
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    return True


def resolve_model_path(path: str) -> str:
    from trainer.backends.tiny_model import tiny_model_named

    tiny = tiny_model_named(path)
    return str(tiny) if tiny is not None else path


def build_peft_model(cfg: RunConfig, device: torch.device, model: Any = None) -> Any:
    """Base model (loaded from cfg.model.path unless given) wrapped with a fresh LoRA adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(cfg.model.dtype, device)
    if model is None:
        kwargs: dict[str, Any] = {"dtype": dtype}
        if cfg.model.attn_implementation:
            kwargs["attn_implementation"] = cfg.model.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model.path), **kwargs)
    model.to(device)
    use_tf32_on_cuda(device)
    apply_gradient_checkpointing(model, cfg.model, device.type == "cuda")
    torch.manual_seed(cfg.lora.seed)
    lora = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    if cfg.trainer.micro_batch_layout == "packed":
        enable_packed_attention(model)
    peft_model = get_peft_model(model, lora)
    # LoRA weights in fp32 even over a bf16 base: Adam updates of size lr*1e-3 vanish in bf16.
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return peft_model


def adamw_step(optimizer: torch.optim.Optimizer, params: list[Any], adam: AdamParams) -> tuple[float, bool]:
    """One AdamW update with this step's hyperparameters, the gradients clipped to adam.grad_clip_norm (0: not
    clipped), then cleared. A NaN/inf gradient norm skips the update: it would poison every LoRA weight and the next
    checkpoint. Returns (gradient norm, skipped)."""
    for group in optimizer.param_groups:
        group.update(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
    max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm).item())
    skipped = not np.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def write_peft_adapter(peft_model: Any, adapter: str, dest: Path, dtype: torch.dtype) -> None:
    """One adapter of `peft_model` as a vLLM-loadable folder (LoRA tensors only, in `dtype`; a MoE model's expert
    LoRA one expert at a time: trainer.backends.expert_lora), written atomically; an existing folder is never
    overwritten."""
    from peft import get_peft_model_state_dict

    if dest.exists():
        raise FileExistsError(f"{dest} exists: adapter folders are never overwritten")
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter, save_embedding_layers=False)
    state, config = per_expert_layout(peft_model, adapter, state)  # unchanged unless experts are adapted
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    with atomic_dir(dest) as tmp:
        save_file(tensors, str(tmp / ADAPTER_FILE))
        failpoint("adapter-save")
        config.save_pretrained(str(tmp))


class TokenLogprobs(torch.nn.Module):
    """The differentiable part of a step as one module (what DDP wraps): token logprobs of a micro-batch, packed or
    padded (trainer.backends.micro_batches)."""

    def __init__(self, peft_model: Any, chunk_tokens: int):
        super().__init__()
        self.peft_model = peft_model
        self.chunk_tokens = chunk_tokens

    def forward(
        self,
        model_inputs: dict[str, torch.Tensor],
        target_ids_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        temperature_B: torch.Tensor | None,
    ) -> torch.Tensor:
        return causal_lm_logprobs(
            self.peft_model.get_base_model(),
            model_inputs,
            target_ids_BT,
            mask_BT != 0,
            temperature_B,
            self.chunk_tokens,
        )


class LocalBackend:
    """TrainingBackend on a local GPU or CPU, or one rank of a torchrun data-parallel job (trainer.backends.data_parallel).
    See trainer.training.backend.TrainingBackend for the contract."""

    def __init__(self, cfg: RunConfig, model: Any = None):
        self.cfg = cfg
        self.ranks = rank_info()
        self.device = resolve_device(cfg)
        if self.device.type == "cpu" and cfg.trainer.cpu_threads is not None:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        init_process_group(cfg.distributed.backend, self.device)
        self.model = build_peft_model(cfg, self.device, model)
        self.net: torch.nn.Module = TokenLogprobs(self.model, cfg.trainer.logprob_chunk_tokens)
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        if self.ranks.world_size > 1:
            # Broadcasts rank 0's LoRA weights (not the frozen base), so every rank starts from the same adapter.
            self.ddp = wrap_data_parallel(self.net, self.device)
            self.net = self.ddp
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr, fused=self.device.type == "cuda")
        self._step = 0
        self.teacher_model: Any = None  # distillation from a model of its own (load_teacher)
        self.url_teacher: UrlTeacher | None = None  # ... or from a server's URL
        self.output_dir = Path(cfg.trainer.output_dir)
        seed_everything(cfg.lora.seed)

    @property
    def step(self) -> int:
        return self._step

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_base_model().get_output_embeddings().weight.shape[0])

    # --- training -------------------------------------------------------------------------------------------

    def forward_backward(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction = "sum",
        scale: BatchScale | None = None,
    ) -> ForwardBackwardResult:
        """Gradients of the whole batch's loss. Under data parallelism every rank is given the whole batch, trains
        its shard, and the summed gradients, loss and metrics are those of the whole batch."""
        if not examples:
            raise ValueError("forward_backward needs at least one example")
        started = time.perf_counter()
        self.model.train()
        # Whole-batch counts on every rank: the per-shard losses then add up to the whole batch's loss.
        scale = scale or BatchScale.of(examples)
        plans = self._my_micro_batches(examples)
        # Fewer examples than ranks: this rank still joins the gradient all-reduce, with weight 0.
        placeholder = not plans
        if placeholder:
            plans = self._micro_batches(examples, [0])
        logprobs: dict[int, list[float]] = {}
        parts, loss_value = [], 0.0
        real_tokens = computed_tokens = 0
        for k, plan in enumerate(plans):
            last = k == len(plans) - 1
            # DDP all-reduces on the last micro-batch only; the others accumulate locally.
            with self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext():
                micro_loss, micro_metrics, lp_BT = self._micro_step(
                    examples, plan, loss, reduction, scale, placeholder
                )
            if placeholder:
                continue
            loss_value += micro_loss
            parts.append(micro_metrics)
            real_tokens += plan.real_tokens
            computed_tokens += plan.computed_tokens
            for row, i in enumerate(plan.indices):
                logprobs[i] = lp_BT[row, : len(examples[i])].tolist()
        if self.ranks.world_size > 1:
            parts, logprobs, loss_value, real_tokens, computed_tokens = self._gather_ranks(
                parts, logprobs, loss_value, real_tokens, computed_tokens
            )
        elapsed = time.perf_counter() - started
        metrics = finalize_metrics(parts)
        metrics.update(
            {
                "loss/value": loss_value,
                "time/forward_backward_s": elapsed,
                "perf/train_tokens_per_s": sum(len(e) for e in examples) / max(elapsed, 1e-9),
                "perf/micro_batches": float(len(parts)),
                "tokens/forward": float(real_tokens),
                "tokens/forward_computed": float(computed_tokens),
            }
        )
        return ForwardBackwardResult(
            trainer_logprobs=[logprobs[i] for i in range(len(examples))], loss=loss_value, metrics=metrics
        )

    def _my_micro_batches(self, examples: Sequence[TrainingExample]) -> list[MicroBatch]:
        """This rank's token-balanced shard of `examples`, cut into micro-batches."""
        mine = shard_indices([len(e) for e in examples], self.ranks.rank, self.ranks.world_size)
        return self._micro_batches(examples, mine)

    def _micro_batches(self, examples: Sequence[TrainingExample], indices: Sequence[int]) -> list[MicroBatch]:
        t = self.cfg.trainer
        return micro_batches.plan(
            examples,
            indices,
            t.micro_batch_tokens,
            t.micro_batch_layout,
            t.shared_prefix_min_tokens,
            self.device,
        )

    @staticmethod
    def _gather_ranks(
        parts: list[Any], logprobs: dict[int, list[float]], loss_value: float, real: int, computed: int
    ) -> tuple[list[Any], dict[int, list[float]], float, int, int]:
        """Every rank's metrics parts, logprobs, loss and token counts, merged into the whole batch's."""
        gathered = gather_objects((parts, logprobs, loss_value, real, computed))
        merged = {i: lp for g in gathered for i, lp in g[1].items()}
        return (
            [p for g in gathered for p in g[0]],
            merged,
            sum(g[2] for g in gathered),
            sum(g[3] for g in gathered),
            sum(g[4] for g in gathered),
        )

    def _micro_step(
        self,
        examples: Sequence[TrainingExample],
        plan: MicroBatch,
        loss: LossParams,
        reduction: Reduction,
        scale: BatchScale,
        zero_weight: bool,
    ) -> tuple[float, dict[str, float], torch.Tensor]:
        chunk = [examples[i] for i in plan.indices]
        batch = {k: v.to(self.device) for k, v in examples_to_tensors(chunk).items()}
        use_temperature = self.cfg.advantage.sampler_logprobs == "processed"
        trainer_lp_BT = self.net(
            plan.model_inputs,
            batch["target_ids_BT"],
            batch["mask_BT"],
            batch["temperature_B"] if use_temperature else None,
        )
        weights_BT = compute_reduction_weights(batch["mask_BT"], reduction, scale.tokens, scale.sequences)
        if zero_weight:
            weights_BT = torch.zeros_like(weights_BT)
        sampler_BT = batch["sampler_logprobs_BT"]
        unknown_BT = torch.isnan(sampler_BT)  # a group sent without sampler logprobs (batch.py, "recompute")
        if unknown_BT.any():
            sampler_BT = torch.where(unknown_BT, trainer_lp_BT.detach(), sampler_BT)
        inputs = LossInputs(
            trainer_logprobs_BT=trainer_lp_BT,
            sampler_logprobs_BT=sampler_BT,
            advantages_BT=batch["advantages_BT"],
            mask_BT=batch["mask_BT"],
            reduction_weights_BT=weights_BT,
        )
        micro_loss, micro_metrics = compute_loss(inputs, loss)
        micro_loss.backward()
        return float(micro_loss.detach().item()), micro_metrics, trainer_lp_BT.detach().cpu()

    def train_step(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction,
        adam: AdamParams,
        scale: BatchScale | None = None,
    ) -> tuple[ForwardBackwardResult, dict[str, float]]:
        return self.forward_backward(examples, loss, reduction, scale), self.optim_step(adam)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        started = time.perf_counter()
        grad_norm, skipped = adamw_step(self.optimizer, self.params, adam)
        self._step += 1
        return {
            "optim/grad_norm": grad_norm,
            "optim/lr": adam.learning_rate,
            "optim/skipped_nonfinite": float(skipped),
            "time/optim_s": time.perf_counter() - started,
        }

    # --- distillation ---------------------------------------------------------------------------------------

    def load_teacher(self, path: str) -> None:
        """A teacher for on-policy distillation (trainer.training.distill.resolve_teacher's answer): a PEFT adapter
        on this model's base, loaded beside the trained adapter (only the base's memory is shared; the teacher's own
        LoRA weights are frozen), or a model of its own in the trainer's dtype and device, frozen."""
        if teacher_kind(path) == "url":  # a server elsewhere scores it (trainer/training/teacher_http.py)
            self.url_teacher = UrlTeacher.from_config(self.cfg)
            return
        if teacher_kind(path) == "model":
            self._load_teacher_model(path)
            return
        from peft import PeftConfig

        adapter_path = path

        found = PeftConfig.from_pretrained(adapter_path)
        base = resolve_model_path(self.cfg.model.path)
        if found.base_model_name_or_path and Path(found.base_model_name_or_path).name != Path(base).name:
            log.warning(
                "teacher adapter %s names base model %s, the trainer's is %s: scored on the trainer's",
                adapter_path,
                found.base_model_name_or_path,
                base,
            )
        self.model.load_adapter(adapter_path, adapter_name=TEACHER, is_trainable=False)
        self.model.set_adapter(STUDENT)  # loading must leave the trained adapter active and trainable
        if [id(p) for p in self.model.parameters() if p.requires_grad] != [id(p) for p in self.params]:
            raise RuntimeError("loading the teacher adapter changed which parameters train")

    def _load_teacher_model(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        dtype = resolve_dtype(self.cfg.model.dtype, self.device)
        teacher: Any = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=dtype)
        teacher.to(self.device)
        teacher.eval().requires_grad_(False)
        if self.cfg.trainer.micro_batch_layout == "packed":
            enable_packed_attention(teacher)
        vocab = int(teacher.get_output_embeddings().weight.shape[0])
        # pre-flight compares the tokenizers; this guards a trainer started by hand
        if vocab != self.vocab_size:
            raise ConfigError(
                f"distill.teacher={path!r} has a vocabulary of {vocab} tokens, the student {self.vocab_size}: the "
                "teacher scores the student's token ids, so both must share one tokenizer"
            )
        self.teacher_model = teacher

    @torch.no_grad()
    def teacher_logprobs(self, examples: Sequence[TrainingExample]) -> list[list[float]]:
        """The teacher's log p(target_t | prefix) of every trained token of `examples` (0.0 elsewhere): from its
        server, or by a forward of the teacher model, or of the base with the teacher adapter active, in the
        trainer's micro-batches; raw logits (temperature 1)."""
        if self.url_teacher is not None:
            return self.url_teacher.teacher_logprobs(examples)
        out: list[list[float]] = [[] for _ in examples]
        plans = self._micro_batches(examples, range(len(examples)))
        causal_lm = self.teacher_model
        if causal_lm is None:
            self.model.eval()
            self.model.set_adapter(TEACHER)
            causal_lm = self.model.get_base_model()
        try:
            for plan in plans:
                batch = {
                    k: v.to(self.device)
                    for k, v in examples_to_tensors([examples[i] for i in plan.indices]).items()
                }
                lp_BT = causal_lm_logprobs(
                    causal_lm,
                    plan.model_inputs,
                    batch["target_ids_BT"],
                    batch["mask_BT"] != 0,
                    None,
                    self.cfg.trainer.logprob_chunk_tokens,
                ).cpu()
                for row, i in enumerate(plan.indices):
                    out[i] = lp_BT[row, : len(examples[i])].tolist()
        finally:
            if (
                self.teacher_model is None
            ):  # PEFT makes the active adapter trainable again, the teacher frozen
                self.model.set_adapter(STUDENT)
        return out

    # --- publish verification -------------------------------------------------------------------------------

    @torch.no_grad()
    def probe_logits(self, prompts: list[list[int]], adapter: bool = True) -> torch.Tensor:
        """[P, V] logits of the next token after each prompt, as float32 on CPU (raw: vLLM reports a greedy
        token's logprobs before any processing); with `adapter=False` the base model's. One forward of the
        equal-length prompts; no gradients, dropout off."""
        was_training = self.model.training
        self.model.eval()
        try:
            ids_BT = torch.tensor(prompts, device=self.device)
            with self._weights_as_saved() if adapter else self.model.disable_adapter():
                logits_BV = self.model(input_ids=ids_BT, use_cache=False).logits[:, -1].float()
        finally:
            self.model.train(was_training)
        return logits_BV.cpu()

    @contextlib.contextmanager
    def _weights_as_saved(self) -> Iterator[None]:
        """The LoRA weights in trainer.save_dtype meanwhile: the sampler serves the written file and computes the
        LoRA path in that dtype (PEFT casts a LoRA layer's input to its weights' dtype), so in bf16 the probe
        scores what vLLM computes, not the fp32 masters; the difference grows with the adapter. Casting is
        idempotent, so an adapter written meanwhile (the probe runs beside the write) is the same file."""
        dtype = resolve_dtype(self.cfg.trainer.save_dtype, self.device)
        if dtype == torch.float32:
            yield
            return
        masters = [p.data for p in self.params]
        for p in self.params:
            p.data = p.data.to(dtype)
        try:
            yield
        finally:
            for p, master in zip(self.params, masters, strict=True):
                p.data = master

    def probe(self, prompts: list[list[int]], top_k: int) -> list[dict[int, float]]:
        """For each prompt, the top-k logprobs of the next token: token id -> logprob."""
        return top_logprobs(torch.log_softmax(self.probe_logits(prompts), dim=-1), top_k)

    # --- saving ---------------------------------------------------------------------------------------------

    def save_for_sampler(self, version: int) -> str:
        """Adapter for policy `version` in a new folder adapters/vNNNNNN (never reused: vLLM's prefix cache)."""
        dest = self.output_dir / "adapters" / f"v{version:06d}"
        dtype = resolve_dtype(self.cfg.trainer.save_dtype, self.device)
        self._write_adapter(dest, dtype)
        return str(dest)

    def _write_adapter(self, dest: Path, dtype: torch.dtype) -> None:
        write_peft_adapter(self.model, "default", dest, dtype)

    def save_state(self, name: str) -> str:
        dest = self.output_dir / "checkpoints" / name
        if dest.exists():
            raise FileExistsError(f"checkpoint {dest} exists; choose a new name")
        self._write_adapter_and_state(dest)
        return str(dest)

    def _write_adapter_and_state(self, dest: Path) -> None:
        from peft import get_peft_model_state_dict

        tensors = {
            k: v.detach().float().contiguous().cpu()
            for k, v in get_peft_model_state_dict(self.model, save_embedding_layers=False).items()
        }
        with atomic_dir(dest) as tmp:
            save_file(tensors, str(tmp / ADAPTER_FILE))
            self.model.peft_config["default"].save_pretrained(str(tmp))
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "step": self._step, "rng": rng_state()},
                tmp / "trainer_state.pt",
            )
            (tmp / "run_config.json").write_text(self.cfg.model_dump_json(indent=2))

    def load_state(self, path: str) -> None:
        from peft import set_peft_model_state_dict

        src = Path(path)
        if not (src / "trainer_state.pt").exists():
            raise FileNotFoundError(f"{src} is not a checkpoint written by save_state (no trainer_state.pt)")
        saved_cfg = json.loads((src / "run_config.json").read_text())
        for section in ("model", "lora"):
            saved, now = saved_cfg[section], json.loads(getattr(self.cfg, section).model_dump_json())
            if (
                section == "model"
            ):  # the same folder reached through a symlink (a moved cache) is the same model
                saved, now = ({**c, "path": _same_folder(c["path"])} for c in (saved, now))
            if saved != now:
                diff = {
                    k: (saved.get(k), now.get(k))
                    for k in saved.keys() | now.keys()
                    if saved.get(k) != now.get(k)
                }
                raise ValueError(
                    f"checkpoint {src} was made with a different '{section}' config ({diff}, saved vs now); "
                    "resume with the same"
                )
        weights = load_file(str(src / ADAPTER_FILE), device=str(self.device))
        unexpected = getattr(set_peft_model_state_dict(self.model, weights), "unexpected_keys", None) or []
        if unexpected:
            raise ValueError(f"checkpoint {src} has unexpected adapter keys: {unexpected[:3]}")
        # weights_only: a checkpoint is data, never code to run (a tampered or foreign file cannot execute).
        state = torch.load(src / "trainer_state.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self._step = int(state["step"])
        set_rng_state(state["rng"])


def _same_folder(path: str) -> str:
    return os.path.realpath(path) if os.path.isdir(path) else path
