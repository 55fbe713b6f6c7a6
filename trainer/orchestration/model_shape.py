"""A decoder model's shape, read from its config.json (Llama/Qwen/Mistral-style, mixtures of experts included), and
the parts a memory plan adds up. Pure: no torch, no GPU, no network but the local Hugging Face cache."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.training.config import RunConfig

GiB = 2**30
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION_PROJECTIONS + MLP_PROJECTIONS  # PEFT's all-linear on these models (lm_head excluded)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP, as its config.json describes it (Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3 keys)."""

    count: int  # routed experts in each MoE layer
    per_token: int  # experts each token goes through
    intermediate: int  # each expert's MLP width
    layers: int  # decoder layers whose MLP is the experts (the rest are dense)
    shared_intermediate: int = 0  # the always-on shared expert's MLP width (Qwen2-MoE, DeepSeek)
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert

    @classmethod
    def from_config(cls, text: dict[str, Any], layers: int) -> Experts | None:
        count = int(
            text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0
        )
        if count <= 1:
            return None
        model_type = str(text.get("model_type", ""))
        step = int(text.get("decoder_sparse_step") or 1)
        dense = set(text.get("mlp_only_layers") or [])
        first_dense = int(text.get("first_k_dense_replace") or 0)
        moe_layers = sum(1 for i in range(first_dense, layers) if i not in dense and (i + 1) % step == 0)
        width = int(text.get("moe_intermediate_size") or text["intermediate_size"])
        shared = (
            int(text.get("shared_expert_intermediate_size") or 0)
            + int(text.get("n_shared_experts") or 0) * width
        )
        return cls(
            count=count,
            per_token=int(text.get("num_experts_per_tok") or 1),
            intermediate=width,
            layers=moe_layers,
            shared_intermediate=shared,
            shared_gate=model_type == "qwen2_moe" and shared > 0,
        )

    def layer_parameters(self, hidden: int) -> int:
        """One MoE layer's MLP: the experts, the router, the shared expert and its gate."""
        experts = self.count * 3 * hidden * self.intermediate + self.count * hidden
        return experts + 3 * hidden * self.shared_intermediate + (hidden if self.shared_gate else 0)

    def lora_parameters(self, hidden: int, rank: int, mlp_targets: set[str]) -> tuple[int, int]:
        """(parameters, tensors) of PEFT's LoRA on one layer's fused experts: gate_up_proj [E, 2I, H] at rank 2r
        (PEFT doubles it), down_proj [E, H, I] at r, each expert a block of A and B, and the router at r."""
        e, i, params, tensors = self.count, self.intermediate, 0, 0
        if {"gate_proj", "up_proj"} & mlp_targets:
            params, tensors = params + e * 2 * rank * (hidden + 2 * i), tensors + 2
        if "down_proj" in mlp_targets:
            params, tensors = params + e * rank * (i + hidden), tensors + 2
        if mlp_targets:
            params, tensors = params + rank * (hidden + e), tensors + 2
        return params, tensors

    def merged_weight_bytes(self, hidden: int) -> int:
        """What PEFT's LoRA on fused experts keeps for backward per layer: each expert's W + delta W, materialised
        for all experts at once, in float32 (the LoRA weights' dtype), gate_up and down (measured on a tiny
        Qwen3-MoE with saved-tensor hooks: exactly these two tensors per layer)."""
        return self.count * 3 * hidden * self.intermediate * 4


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder-only transformer's config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    max_positions: int | None = None
    dtype: str | None = None  # torch_dtype/dtype in config.json: what vLLM's --dtype auto serves
    experts: Experts | None = None  # a mixture-of-experts MLP (None: dense)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        text = (
            config.get("text_config") or config
        )  # multimodal wrappers keep the decoder's keys in text_config
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        model_type = str(text.get("model_type", ""))
        layers = int(text["num_hidden_layers"])
        return cls(
            hidden=hidden,
            intermediate=int(text["intermediate_size"]),
            layers=layers,
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab=int(text["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            attention_bias=bool(text.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type.startswith("qwen3"),
            max_positions=text.get("max_position_embeddings"),
            dtype=text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype"),
            experts=Experts.from_config(text, layers),
        )

    @property
    def dense_layers(self) -> int:
        return self.layers - (self.experts.layers if self.experts else 0)

    @property
    def mlp_width(self) -> int:
        """The widest MLP a token passes through in one layer: a dense layer's, or the experts it is routed to plus
        the shared expert (what the MLP's activations scale with)."""
        widths = [self.intermediate] if self.dense_layers else []
        if self.experts is not None:
            widths.append(
                self.experts.per_token * self.experts.intermediate + self.experts.shared_intermediate
            )
        return max(widths)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection in one layer, and of lm_head."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "lm_head": (h, self.vocab),
        }

    def parameter_count(self) -> int:
        shapes = self.linear_shapes()
        attention = (
            sum(a * b for name, (a, b) in shapes.items() if name in ATTENTION_PROJECTIONS) + 2 * self.hidden
        )
        if self.attention_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attention += 2 * self.head_dim
        dense_mlp = sum(a * b for name, (a, b) in shapes.items() if name in MLP_PROJECTIONS)
        moe = self.experts.layers * self.experts.layer_parameters(self.hidden) if self.experts else 0
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * attention + self.dense_layers * dense_mlp + moe + self.hidden + embeddings


def lora_targets(cfg: RunConfig) -> list[str]:
    if cfg.lora.target_modules == "all-linear":
        return list(ALL_LINEAR)
    return [m for m in (*ALL_LINEAR, "lm_head") if m in cfg.lora.target_modules]


def published_rank(shape: ModelShape, cfg: RunConfig) -> int:
    """The rank of the adapters the trainer publishes: lora.rank, or twice it when a MoE model's experts are
    adapted (PEFT trains the fused gate_up experts at 2r, and every module is written at that rank:
    trainer/backends/expert_lora.py). vLLM's --max-lora-rank must be at least this."""
    adapts_experts = shape.experts is not None and bool(set(lora_targets(cfg)) & set(MLP_PROJECTIONS))
    return cfg.lora.rank * (2 if adapts_experts else 1)


@dataclass
class Part:
    name: str
    bytes: int
    note: str = ""


@dataclass
class ProcessPlan:
    parts: list[Part] = field(default_factory=list)

    def add(self, name: str, nbytes: float, note: str = "") -> None:
        self.parts.append(Part(name, int(nbytes), note))

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def get(self, prefix: str) -> int:
        return sum(p.bytes for p in self.parts if p.name.startswith(prefix))


def dtype_bytes(name: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r} for the memory plan")
    return DTYPE_BYTES[name]


def load_model_config(path: str) -> dict[str, Any] | None:
    """config.json of a local folder, the offline tiny model, or a hub id in the local HF cache (None if none)."""
    if path in ("tiny", "tiny-moe"):
        from trainer.backends.tiny_model import MODEL_SHAPE, MOE_SHAPE, VOCAB_SIZE

        return {
            **MODEL_SHAPE,
            **(MOE_SHAPE | {"model_type": "qwen3_moe"} if path == "tiny-moe" else {}),
            "vocab_size": VOCAB_SIZE,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
    folder = Path(path)
    if (folder / "config.json").is_file():
        return dict(json.loads((folder / "config.json").read_text()))
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
    except Exception:  # not a valid repo id
        return None
    if isinstance(cached, str):
        return dict(json.loads(Path(cached).read_text()))
    return None
