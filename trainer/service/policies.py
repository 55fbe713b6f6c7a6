"""Several LoRA policies on one base model: one PEFT model holds every training client's adapter; each client has its
own parameters, gradients and AdamW state.

Isolation comes from PEFT's active adapter: a call first makes its client's adapter the active one, which (PEFT's
set_adapter) also leaves only that adapter's parameters requiring gradients, so a backward pass writes gradients into
that client's parameters alone, and they stay there, untouched by other clients' calls, until its optim_step. Calls
are not thread-safe: the service runs them one at a time (they share the base model's forward).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.backends import micro_batches
from trainer.backends.checkpointing import apply_gradient_checkpointing
from trainer.backends.local import (
    TokenLogprobs,
    adamw_step,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    write_peft_adapter,
)
from trainer.backends.packed_forward import enable_packed_attention
from trainer.service.wire import SoftTargets
from trainer.training.backend import AdamParams
from trainer.training.batch import TrainingExample, examples_to_tensors
from trainer.training.config import RunConfig
from trainer.training.lora_spec import ATTN, MLP, UNEMBED
from trainer.training.loss_params import LossParams
from trainer.training.losses import LossInputs, compute_loss, compute_reduction_weights, soft_cross_entropy

ADAPTER_KEY = "{adapter}"  # stands for the adapter's name in saved parameter names


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def targets(self) -> list[str]:
        return [
            *(ATTN if self.train_attn else ()),
            *(MLP if self.train_mlp else ()),
            *(UNEMBED if self.train_unembed else ()),
        ]


@dataclass
class Client:
    name: str  # the adapter's name in the PEFT model
    spec: LoraSpec
    params: dict[str, torch.nn.Parameter]  # by name, the adapter's name replaced by ADAPTER_KEY
    optimizer: torch.optim.AdamW
    steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class MultiLora:
    def __init__(self, cfg: RunConfig, model: Any = None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = resolve_device(cfg)
        if self.device.type == "cpu" and cfg.trainer.cpu_threads is not None:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        self.model_path = resolve_model_path(cfg.model.path)
        if model is None:
            kwargs: dict[str, Any] = {"dtype": resolve_dtype(cfg.model.dtype, self.device)}
            if cfg.model.attn_implementation:
                kwargs["attn_implementation"] = cfg.model.attn_implementation
            model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs)
        self.base = model.to(self.device)
        if cfg.trainer.micro_batch_layout == "packed":
            enable_packed_attention(self.base)
        apply_gradient_checkpointing(self.base, cfg.model, self.device.type == "cuda")
        self.base.requires_grad_(False)
        self.peft: Any = None
        self.clients: dict[str, Client] = {}
        self._dormant: list[str] = []  # released adapters PEFT still holds
        self._modules = {name.rsplit(".", 1)[-1] for name, _ in self.base.named_modules()}

    @property
    def vocab_size(self) -> int:
        return int(self.base.get_output_embeddings().weight.shape[0])

    @property
    def arch(self) -> str:
        return str(getattr(self.base.config, "model_type", "unknown"))

    # --- adapters ---------------------------------------------------------------------------------------------

    def create(self, name: str, spec: LoraSpec) -> None:
        from peft import LoraConfig, get_peft_model

        targets = [t for t in spec.targets() if t in self._modules]
        if not targets:
            raise ValueError(
                f"train_attn/train_mlp/train_unembed select none of this model's modules ({spec.targets()})"
            )
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=self.cfg.lora.alpha,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        torch.manual_seed(spec.seed)
        if self.peft is None:
            self.peft = get_peft_model(self.base, config, adapter_name=name)
            self.net = TokenLogprobs(self.peft, self.cfg.trainer.logprob_chunk_tokens)
        else:
            self.peft.add_adapter(name, config)
        marker = f".{name}."
        params = {}
        for pname, p in self.peft.named_parameters():
            if marker in pname and "lora_" in pname:
                p.data = p.data.float()  # fp32 LoRA over any base: Adam steps of lr*1e-3 vanish in bf16
                params[pname.replace(marker, f".{ADAPTER_KEY}.")] = p
        optimizer = torch.optim.AdamW(list(params.values()), lr=self.cfg.optim.lr)
        self.clients[name] = Client(name, spec, params, optimizer)
        self._drop_dormant()

    def release(self, name: str) -> None:
        """Forget a client: its adapter, gradients and Adam state go. PEFT keeps at least one adapter, so the last
        one stays loaded (unused) until the next client is created."""
        del self.clients[name]
        self._dormant.append(name)
        self._drop_dormant()

    def _drop_dormant(self) -> None:
        for name in list(self._dormant):
            if len(self.peft.peft_config) > 1:
                if self.peft.active_adapter == name:
                    self.peft.set_adapter(next(n for n in self.peft.peft_config if n != name))
                self.peft.delete_adapter(name)
                self._dormant.remove(name)

    def _activate(self, name: str) -> Client:
        client = self.clients[name]
        self.peft.set_adapter(name)
        return client

    # --- training ---------------------------------------------------------------------------------------------

    def forward_backward(
        self,
        name: str,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        backward: bool,
        soft_targets: Sequence[SoftTargets | None] = (),
        sequence_masks: Sequence[list[float] | None] = (),
    ) -> tuple[list[np.ndarray], float, dict[str, float]]:
        """Target logprobs per example ((N,) or, for (N, K) soft_targets, (N, K)), the summed loss (Tinker's
        reduction), and its gradients accumulated into the client's adapter when `backward`. sequence_masks: gspo's
        sequence_ratio_mask per example (None: its trained tokens)."""
        started = time.perf_counter()
        self._activate(name)
        self.peft.train(backward)
        soft = list(soft_targets) or [None] * len(examples)
        masks = list(sequence_masks) or [None] * len(examples)
        logprobs: dict[int, np.ndarray] = {}
        total = 0.0
        t = self.cfg.trainer
        plans = micro_batches.plan(
            examples,
            range(len(examples)),
            t.micro_batch_tokens,
            t.micro_batch_layout,
            t.shared_prefix_min_tokens,
            self.device,
        )
        with torch.enable_grad() if backward else torch.no_grad():
            for micro in plans:
                plan = micro.indices
                chunk = [examples[i] for i in plan]
                batch = {k: v.to(self.device) for k, v in examples_to_tensors(chunk).items()}
                if any(soft[i] is not None for i in plan):
                    value, lp_BT = self._soft_step(micro.model_inputs, batch, chunk, [soft[i] for i in plan])
                else:
                    value, lp_BT = self._step(
                        micro.model_inputs, batch, chunk, [masks[i] for i in plan], loss
                    )
                if backward:
                    value.backward()
                total += float(value.detach().item())
                for row, i in enumerate(plan):
                    out = lp_BT[row, : len(examples[i])]
                    target = soft[i]
                    if target is not None:
                        out = out[:, : target.target_ids.shape[1]]
                    elif out.dim() == 2:  # a plain datum beside (N, K) ones: its targets are column 0
                        out = out[:, 0]
                    logprobs[i] = out.detach().float().cpu().numpy()
        tokens = float(sum(len(e) for e in examples))
        metrics = {"loss:sum": total, "tokens:sum": tokens, "seconds:max": time.perf_counter() - started}
        return [logprobs[i] for i in range(len(examples))], total, metrics

    def _step(
        self,
        model_inputs: dict[str, torch.Tensor],
        batch: dict[str, torch.Tensor],
        chunk: list[TrainingExample],
        sequence_masks: list[list[float] | None],
        loss: LossParams,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Every real token's logprob, whatever its weight: forward() answers them all (a custom loss gets them
        # from a cross_entropy forward whose weights are zero), and gspo's sequence mask may reach past the weights.
        lp_BT = self.net(model_inputs, batch["target_ids_BT"], batch["attention_mask_BT"], None)
        sequence_mask_BT = None
        if any(m is not None for m in sequence_masks):
            sequence_mask_BT = batch["mask_BT"].clone()
            for row, (example, mask) in enumerate(zip(chunk, sequence_masks, strict=True)):
                if mask is not None:
                    sequence_mask_BT[row, : len(example)] = torch.tensor(mask)
        inputs = LossInputs(
            trainer_logprobs_BT=lp_BT,
            sampler_logprobs_BT=batch["sampler_logprobs_BT"],
            advantages_BT=batch["advantages_BT"],
            mask_BT=batch["mask_BT"],
            reduction_weights_BT=compute_reduction_weights(batch["mask_BT"], "sum", 0.0, 0),
            sequence_mask_BT=sequence_mask_BT,
        )
        value, _ = compute_loss(inputs, loss)
        return value, lp_BT

    def _soft_step(
        self,
        model_inputs: dict[str, torch.Tensor],
        batch: dict[str, torch.Tensor],
        chunk: list[TrainingExample],
        soft: list[SoftTargets | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cross_entropy over [B, T, K] targets, K the widest in the micro-batch: a plain datum is K = 1 with its
        weights, and the cells past a datum's own K carry weight 0."""
        B, T = batch["target_ids_BT"].shape
        K = max(s.target_ids.shape[1] for s in soft if s is not None)
        targets_BTK = torch.zeros((B, T, K), dtype=torch.long)
        weights_BTK = torch.zeros((B, T, K), dtype=torch.float32)
        for row, (example, target) in enumerate(zip(chunk, soft, strict=True)):
            n = len(example)
            if target is None:
                targets_BTK[row, :n, 0] = torch.tensor(example.target_ids)
                weights_BTK[row, :n, 0] = torch.tensor(example.loss_mask)
            else:
                k = target.target_ids.shape[1]
                targets_BTK[row, :n, :k] = torch.from_numpy(target.target_ids)
                weights_BTK[row, :n, :k] = torch.from_numpy(target.weights)
        lp_BTK = self.net(model_inputs, targets_BTK.to(self.device), batch["attention_mask_BT"], None)
        return soft_cross_entropy(lp_BTK, weights_BTK.to(self.device)), lp_BTK

    def optim_step(self, name: str, adam: AdamParams) -> dict[str, float]:
        client = self._activate(name)
        grad_norm, skipped = adamw_step(client.optimizer, list(client.params.values()), adam)
        client.steps += 1
        return {"grad_norm": grad_norm, "skipped_nonfinite": float(skipped), "step": float(client.steps)}

    # --- state ------------------------------------------------------------------------------------------------

    def save_state(self, name: str, folder: Path) -> None:
        """Adapter weights, AdamW state, step count and LoRA spec: what load_state needs to continue exactly."""
        client = self.clients[name]
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: p.detach().cpu().contiguous() for k, p in client.params.items()},
            folder / "adapter.safetensors",
        )
        torch.save(client.optimizer.state_dict(), folder / "optimizer.pt")
        meta = {"spec": client.spec.__dict__, "steps": client.steps, "order": list(client.params)}
        (folder / "state.json").write_text(json.dumps(meta))

    @staticmethod
    def read_spec(folder: Path) -> LoraSpec:
        return LoraSpec(**json.loads((folder / "state.json").read_text())["spec"])

    def load_state(self, name: str, folder: Path, optimizer: bool) -> None:
        client = self.clients[name]
        meta = json.loads((folder / "state.json").read_text())
        if LoraSpec(**meta["spec"]) != client.spec or meta["order"] != list(client.params):
            raise ValueError(
                f"the state in {folder} is of another adapter shape ({meta['spec']}) than this client's "
                f"({client.spec.__dict__}); create the client from the state instead"
            )
        weights = load_file(folder / "adapter.safetensors")
        with torch.no_grad():
            for key, p in client.params.items():
                p.copy_(weights[key].to(p.device))
        if optimizer:
            client.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
            client.steps = int(meta["steps"])
        else:
            client.optimizer.state.clear()
            client.steps = 0
        client.optimizer.zero_grad(set_to_none=True)

    def save_for_sampler(self, name: str, folder: Path) -> None:
        """The adapter as a PEFT folder for vLLM (checked against the gateway's pre-load adapter check)."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        write_peft_adapter(self.peft, name, folder, torch.float32)

    def snapshot(self, name: str) -> dict[str, torch.Tensor]:
        """The client's weights and Adam moments, copied (tests compare them bit for bit)."""
        client = self.clients[name]
        out = {f"w/{k}": p.detach().clone() for k, p in client.params.items()}
        for i, p in enumerate(client.params.values()):
            for key, value in client.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    out[f"adam/{i}/{key}"] = value.detach().clone()
        return out
