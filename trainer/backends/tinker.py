"""Training through Tinker's service: the same TrainingBackend interface as the local backend, with Tinker's
built-in losses doing the math remotely. `tinker` is imported only here, and only when this backend is built.

How our options map onto Tinker's sum-reduced losses:
- reductions other than `sum` scale each token's advantage (or cross-entropy weight) by its reduction weight;
  every Tinker loss except dro is positively homogeneous in the advantage, so this gives the same loss and
  gradient. dro and tis_cap have no Tinker equivalent and are refused.
- `grpo` is Tinker's `ppo` with the same 0.8/1.2 ratio bounds (the group-std advantages come from intake).
- prompt positions get advantage 0 (Tinker has no mask for RL losses); cross-entropy uses the mask as weights.
Every network wait has a deadline, so a wrong key or an unreachable service fails in seconds, not minutes.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.training.backend import AdamParams, ForwardBackwardResult
from trainer.training.batch import TrainingExample, examples_to_tensors
from trainer.training.checkpoints import write_atomic
from trainer.training.config import ConfigError, RunConfig
from trainer.training.lora_spec import LoraMismatch, tinker_lora_flags
from trainer.training.loss_params import LossParams, Reduction
from trainer.training.losses import (
    BatchScale,
    LossInputs,
    compute_loss,
    compute_reduction_weights,
    finalize_metrics,
)

TINKER_LOSS = {
    "cross_entropy": "cross_entropy",
    "importance_sampling": "importance_sampling",
    "ppo": "ppo",
    "cispo": "cispo",
    "grpo": "ppo",
    "gspo": "gspo",
}
STATE_FILE = "tinker_state.json"


def import_tinker() -> Any:
    try:
        return importlib.import_module("tinker")
    except ImportError as exc:
        raise ConfigError(
            "--backend tinker needs the tinker SDK: pip install -e '.[tinker]' "
            "(or `bash launch.sh --setup` after adding the extra)"
        ) from exc


def check_api_key() -> str:
    """Fail at once, before any network: no key, or one of the wrong shape."""
    key = os.environ.get("TINKER_API_KEY", "")
    if not key:
        raise ConfigError(
            "TINKER_API_KEY is not set: export your Tinker API key (it starts with 'tml-') or run "
            "with --backend local"
        )
    if not key.startswith(("tml-", "eyJ")):
        raise ConfigError(
            f"TINKER_API_KEY does not look like a Tinker key (starts with {key[:4]!r}, expected "
            "'tml-'): copy it again from the Tinker console"
        )
    return key


def load_factory(spec: str) -> Callable[[], Any]:
    """`module:attr` naming a callable that returns a ServiceClient-like object."""
    module, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"tinker.client_factory={spec!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def build_service_client(cfg: RunConfig) -> Any:
    if cfg.tinker.client_factory:
        return load_factory(cfg.tinker.client_factory)()
    check_api_key()
    return import_tinker().ServiceClient()


def wait(future: Any, timeout_s: float, what: str) -> Any:
    """Resolve a Tinker future with a deadline and a message that says what was waited for."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError as exc:
        raise RuntimeError(
            f"Tinker did not answer {what} within {timeout_s:.0f}s "
            f"(TINKER_BASE_URL={os.environ.get('TINKER_BASE_URL', 'default')}); check the network "
            "and the service status"
        ) from exc


def check_base_model(service: Any, base_model: str, timeout_s: float) -> None:
    """Refuse a base model Tinker cannot train, listing the ones it can."""
    # The SDK's RestClient answers with a future (the deadline applies); ServiceClient.get_server_capabilities is
    # a deprecated blocking call without one.
    rest = getattr(service, "create_rest_client", None)
    if rest is None:
        return
    caps = wait(rest().get_server_capabilities(), timeout_s, "the capabilities request")
    trainable = sorted(
        m.model_name for m in caps.supported_models if m.model_name and m.trainable is not False
    )
    if trainable and base_model not in trainable:
        raise ConfigError(
            f"model.path={base_model!r} is not a base model Tinker can train; supported: {trainable}"
        )


def build_datums(
    examples: Sequence[TrainingExample],
    loss: LossParams,
    weights_BT: torch.Tensor,
    tensors: dict[str, torch.Tensor],
) -> list[Any]:
    """Tinker Datums: inputs, targets, and per-token advantages (or CE weights) scaled by the reduction."""
    tinker = import_tinker()
    datums = []
    for b, ex in enumerate(examples):
        n = len(ex)
        mask = tensors["mask_BT"][b, :n]
        scale = (weights_BT[b, :n] * mask).float()
        inputs: dict[str, Any] = {
            "target_tokens": tinker.TensorData.from_torch(tensors["target_ids_BT"][b, :n])
        }
        if loss.name == "cross_entropy":
            inputs["weights"] = tinker.TensorData.from_torch(scale)
        else:
            inputs["logprobs"] = tinker.TensorData.from_torch(tensors["sampler_logprobs_BT"][b, :n].float())
            inputs["advantages"] = tinker.TensorData.from_torch(
                tensors["advantages_BT"][b, :n].float() * scale
            )
        if loss.name == "gspo":  # the trained tokens make the sequence ratio, as the local backend's default
            inputs["sequence_ratio_mask"] = tinker.TensorData.from_torch((mask != 0).float())
        datums.append(
            tinker.Datum(model_input=tinker.ModelInput.from_ints(ex.input_ids), loss_fn_inputs=inputs)
        )
    return datums


def loss_fn_config(loss: LossParams) -> dict[str, float] | None:
    if loss.name not in ("ppo", "grpo", "gspo", "cispo"):
        return None
    low, high = loss.clip_bounds()
    return {"clip_low_threshold": low, "clip_high_threshold": high}


class TinkerBackend:
    """TrainingBackend on Tinker. See trainer.training.backend.TrainingBackend for the contract."""

    def __init__(self, cfg: RunConfig, service: Any = None, tokenizer: Any = None):
        self.cfg = cfg
        self.timeout_s = cfg.tinker.timeout_s
        self.service = service if service is not None else build_service_client(cfg)
        check_base_model(self.service, cfg.model.path, self.timeout_s)
        try:
            flags = tinker_lora_flags(cfg.lora)  # the same adapter a local run of this recipe trains
        except LoraMismatch as exc:
            raise ConfigError(str(exc)) from None
        self.client = wait(
            self.service.create_lora_training_client(
                base_model=cfg.model.path, rank=cfg.lora.rank, seed=cfg.lora.seed, **flags
            ),
            self.timeout_s,
            "the training-client creation",
        )
        self._tokenizer = tokenizer
        self.teacher: Any = None  # a sampling client of the distillation teacher (load_teacher)
        self._step = 0
        self.output_dir = Path(cfg.trainer.output_dir)

    @property
    def step(self) -> int:
        return self._step

    @property
    def vocab_size(self) -> int:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg.tinker.tokenizer or self.cfg.model.path)
        return len(self._tokenizer)

    def _check_loss(self, loss: LossParams, reduction: Reduction) -> None:
        if loss.name not in TINKER_LOSS:
            raise ConfigError(
                f"loss.name={loss.name!r} has no Tinker equivalent with our reductions; use one of "
                f"{sorted(TINKER_LOSS)} with --backend tinker"
            )
        if loss.tis_cap is not None:
            raise ConfigError("loss.tis_cap is not available with --backend tinker")
        if loss.ratio_mask != "none":
            # Tinker computes the ratio inside its own loss and takes no per-token mask from the ratio.
            raise ConfigError(
                f"loss.ratio_mask={loss.ratio_mask} is not available with --backend tinker: Tinker's losses take no "
                "mask computed from the ratio; use --backend local, or loss.ratio_mask=none"
            )

    def _submit(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction,
        scale: BatchScale | None,
    ) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        self._check_loss(loss, reduction)
        tensors = examples_to_tensors(list(examples))
        scale = scale or BatchScale.of(examples)
        weights_BT = compute_reduction_weights(tensors["mask_BT"], reduction, scale.tokens, scale.sequences)
        datums = build_datums(examples, loss, weights_BT, tensors)
        future = self.client.forward_backward(datums, TINKER_LOSS[loss.name], loss_fn_config(loss))
        return future, tensors, weights_BT

    def _result(
        self,
        future: Any,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        tensors: dict[str, torch.Tensor],
        weights_BT: torch.Tensor,
        started: float,
    ) -> ForwardBackwardResult:
        out = wait(future, self.timeout_s, "forward_backward")
        trainer_lp_BT = torch.zeros_like(tensors["mask_BT"])
        logprobs = []
        for b, (ex, item) in enumerate(zip(examples, out.loss_fn_outputs)):
            values = [float(v) for v in item["logprobs"].tolist()]
            trainer_lp_BT[b, : len(values)] = torch.tensor(values)
            logprobs.append([v if m else 0.0 for v, m in zip(values, ex.loss_mask)])
        # Same metric definitions as the local backend, from Tinker's logprobs (no gradient needed here).
        _, parts = compute_loss(
            LossInputs(
                trainer_lp_BT,
                tensors["sampler_logprobs_BT"],
                tensors["advantages_BT"],
                tensors["mask_BT"],
                weights_BT,
            ),
            loss,
        )
        metrics = finalize_metrics([parts])
        loss_value = float(out.metrics.get("loss:sum", 0.0))
        elapsed = time.perf_counter() - started
        metrics.update(
            {
                "loss/value": loss_value,
                "time/forward_backward_s": elapsed,
                "perf/train_tokens_per_s": sum(len(e) for e in examples) / max(elapsed, 1e-9),
            }
        )
        return ForwardBackwardResult(trainer_logprobs=logprobs, loss=loss_value, metrics=metrics)

    def forward_backward(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction = "sum",
        scale: BatchScale | None = None,
    ) -> ForwardBackwardResult:
        started = time.perf_counter()
        future, tensors, weights_BT = self._submit(examples, loss, reduction, scale)
        return self._result(future, examples, loss, tensors, weights_BT, started)

    def _adam(self, adam: AdamParams) -> Any:
        return import_tinker().AdamParams(
            learning_rate=adam.learning_rate,
            beta1=adam.beta1,
            beta2=adam.beta2,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm,
        )

    def _optim_metrics(self, response: Any, adam: AdamParams, started: float) -> dict[str, float]:
        self._step += 1
        remote = dict(getattr(response, "metrics", None) or {})
        # Only what Tinker measured: no grad norm when it reports none, and never optim/skipped_nonfinite (Tinker
        # says nothing about non-finite updates), so the row holds None there rather than an invented 0.
        metrics = {"optim/lr": adam.learning_rate, "time/optim_s": time.perf_counter() - started}
        grad_norm = next((float(v) for k, v in remote.items() if "grad_norm" in k), None)
        if grad_norm is not None:
            metrics["optim/grad_norm"] = grad_norm
        return metrics

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        started = time.perf_counter()
        response = wait(self.client.optim_step(self._adam(adam)), self.timeout_s, "optim_step")
        return self._optim_metrics(response, adam, started)

    def train_step(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction,
        adam: AdamParams,
        scale: BatchScale | None = None,
    ) -> tuple[ForwardBackwardResult, dict[str, float]]:
        """Submit forward_backward and optim_step together (one Tinker clock cycle), then wait for both."""
        started = time.perf_counter()
        fb_future, tensors, weights_BT = self._submit(examples, loss, reduction, scale)
        optim_future = self.client.optim_step(self._adam(adam))
        fb = self._result(fb_future, examples, loss, tensors, weights_BT, started)
        # Both calls run back to back on Tinker's side: the optimizer's own time is what is left after fb.
        fb_done = time.perf_counter()
        response = wait(optim_future, self.timeout_s, "optim_step")
        return fb, self._optim_metrics(response, adam, fb_done)

    # --- distillation ---------------------------------------------------------------------------------------

    def load_teacher(self, teacher: str) -> None:
        """A distillation teacher that lives on Tinker: a sampler checkpoint (tinker://...) or a base model Tinker
        serves, scored through a sampling client of its own."""
        kind = {"model_path": teacher} if teacher.startswith("tinker://") else {"base_model": teacher}
        self.teacher = wait(
            self.service.create_sampling_client(**kind), self.timeout_s, "the teacher's sampling client"
        )

    def teacher_logprobs(self, examples: Sequence[TrainingExample]) -> list[list[float]]:
        """The teacher's logprob of every trained token of `examples` (0.0 elsewhere): compute_logprobs of each
        whole sequence, all submitted before any is awaited, scoring only from the first trained token on (the
        prefix before it comes from Tinker's prefix cache)."""
        types = import_tinker().types
        futures = []
        for ex in examples:
            tokens = [*ex.input_ids, ex.target_ids[-1]]  # position t+1 holds target t
            first = next((t for t, m in enumerate(ex.loss_mask) if m), None)
            last_n = None if first is None else len(tokens) - 1 - first
            futures.append(
                self.teacher.compute_logprobs(
                    types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=last_n
                )
                if last_n
                else None
            )
        out = []
        for ex, future in zip(examples, futures, strict=True):
            scored = (
                wait(future, self.timeout_s, "the teacher's compute_logprobs") if future is not None else []
            )
            row = []
            for t, m in enumerate(ex.loss_mask):
                value = scored[t + 1] if m else None
                if m and value is None:
                    raise RuntimeError(f"Tinker answered no teacher logprob for trained position {t}")
                row.append(float(value) if value is not None else 0.0)
            out.append(row)
        return out

    def save_for_sampler(self, version: int) -> str:
        response = wait(
            self.client.save_weights_for_sampler(f"v{version:06d}"),
            self.timeout_s,
            "save_weights_for_sampler",
        )
        return str(response.path)

    def save_state(self, name: str) -> str:
        dest = self.output_dir / "checkpoints" / name
        if dest.exists():
            raise FileExistsError(f"checkpoint {dest} exists; choose a new name")
        response = wait(self.client.save_state(name), self.timeout_s, "save_state")
        dest.mkdir(parents=True)
        write_atomic(  # a folder without its record is set aside at resume, never loaded
            dest / STATE_FILE,
            json.dumps(
                {
                    "state_path": str(response.path),
                    "step": self._step,
                    "base_model": self.cfg.model.path,
                    "rank": self.cfg.lora.rank,
                }
            ),
        )
        return str(dest)

    def load_state(self, path: str) -> None:
        record_file = Path(path) / STATE_FILE
        if not record_file.is_file():
            raise FileNotFoundError(f"{path} is not a Tinker checkpoint (no {STATE_FILE})")
        record = json.loads(record_file.read_text())
        if (record["base_model"], record["rank"]) != (self.cfg.model.path, self.cfg.lora.rank):
            raise ValueError(
                f"checkpoint {path} is for {record['base_model']} rank {record['rank']}; resume with "
                "the same model and rank"
            )
        self.client = wait(
            self.service.create_training_client_from_state_with_optimizer(record["state_path"]),
            self.timeout_s,
            "the resume from a saved state",
        )
        self._step = int(record["step"])
