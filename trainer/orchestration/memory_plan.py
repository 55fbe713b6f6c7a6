"""Expected peak GPU memory of a run config, for the trainer and for vLLM, and whether they fit one GPU.

Pure arithmetic on the run config and the model's config.json (a Llama/Qwen/Mistral-style decoder): no torch, no
GPU, no network. The launcher prints the plan on --dry-run and refuses, before anything starts, a CUDA config
that cannot fit, naming the knob to turn. The activation terms count the tensors autograd keeps for the code as
it is (trainer/backends/local.py, trainer/training/logprobs.py, PEFT's LoRA Linear, transformers' Llama layers);
tests/unit/test_memory_plan.py checks them against measured peaks on CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcommon.slots import lora_slots
from trainer.training.config import RunConfig
from trainer.training.packing import KEYS_PER_TOKEN

GiB = 2**30
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION_PROJECTIONS + MLP_PROJECTIONS  # PEFT's all-linear on these models (lm_head excluded)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "float32": 4, "float": 4}
# Allowances, not derived: a CUDA context with torch's kernels loaded (~0.5 GiB on an H100), cuBLAS workspaces and
# the caching allocator's rounding and fragmentation for the trainer. vLLM 0.32 takes its start-up snapshot after
# its CUDA context and NCCL exist (vllm/v1/worker/gpu_worker.py init_device), so those sit outside its
# --gpu-memory-utilization budget; the non-torch memory it allocates later (cuBLAS and attention workspaces) sits
# inside. They are round numbers to keep a margin, not measurements.
TRAINER_CUDA_ALLOWANCE = 1 * GiB
VLLM_RUNTIME_ALLOWANCE = 1 * GiB  # inside the budget
VLLM_CONTEXT_ALLOWANCE = 1 * GiB  # outside the budget
VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM 0.32's --gpu-memory-utilization default (vllm/config/cache.py)
VLLM_BLOCK_TOKENS = 16  # KV cache is allocated in blocks of this many tokens
VLLM_MAX_GRAPH_TOKENS = 512  # vLLM 0.32's largest default CUDA-graph batch (1024 on B200/B300 only)
# vLLM 0.32 captures CUDA graphs during start-up profiling and takes its estimate from the budget before sizing the
# KV cache (gpu_worker.py determine_available_memory; VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1). The
# estimate (gpu_model_runner.py profile_cudagraph_memory) is measured: per mode, the first (largest) capture plus
# the second capture's cost times the remaining graphs. The graph count follows vLLM's rules below; the cost per
# graph is an allowance: a published Qwen3-8B start-up log (LMCache issue 3430) shows 0.52 GiB for 86 graphs
# without LoRA, about 6 MiB each.
VLLM_GRAPH_BYTES = 8 * 2**20


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


def trainer_dtype(cfg: RunConfig, on_cuda: bool) -> str:
    if cfg.model.dtype == "auto":
        return "bfloat16" if on_cuda else "float32"
    return cfg.model.dtype


def lora_parameter_count(shape: ModelShape, cfg: RunConfig) -> tuple[int, int]:
    """(parameters, tensors) of the LoRA adapter: A is r x in, B is out x r, per targeted module."""
    shapes, r = shape.linear_shapes(), cfg.lora.rank
    params = tensors = 0
    for name in lora_targets(cfg):
        fan_in, fan_out = shapes[name]
        count = 1 if name == "lm_head" else shape.dense_layers if name in MLP_PROJECTIONS else shape.layers
        params += count * r * (fan_in + fan_out)
        tensors += 2 * count
    if shape.experts is not None:
        mlp = set(lora_targets(cfg)) & set(MLP_PROJECTIONS)
        per_layer, per_layer_tensors = shape.experts.lora_parameters(shape.hidden, r, mlp)
        params += shape.experts.layers * per_layer
        tensors += shape.experts.layers * per_layer_tensors
    return params, tensors


def compute_layer_saved_bytes(
    shape: ModelShape, cfg: RunConfig, tokens: int, b: int, input_grad: bool
) -> float:
    """Bytes autograd keeps for one decoder layer's backward over `tokens` padded tokens (b: bytes per base
    element). LoRA weights are fp32 (local.py), so over a bf16 base PEFT casts each adapted module's input to an
    fp32 copy that it keeps; over an fp32 base the inputs themselves are kept, shared between modules."""
    n, h, i, qd = tokens, shape.hidden, shape.mlp_width, shape.q_dim
    targets = [t for t in lora_targets(cfg) if t != "lm_head"]
    seq = min(cfg.trainer.max_seq_len, tokens)
    packed = cfg.trainer.micro_batch_layout == "packed"
    eager = cfg.model.attn_implementation == "eager" and not packed
    flash = (cfg.model.attn_implementation or "").startswith("flash")
    # RMSNorm keeps its input as fp32 (a copy over bf16) and the per-token rsqrt; layer 0's input needs no grad.
    saved = (2 if input_grad else 1) * (n * h * 4 + n * 4)
    if packed:
        # The packed attention's gathered copies, which its SDPA keeps: q, k and v at their own head count for
        # every key a segment reads, its shared prefix's included (packing.KEYS_PER_TOKEN bounds those per
        # computed token); then the output and log-sum-exp. The bool mask is one per micro-batch, counted below.
        saved += n * (qd + 2 * KEYS_PER_TOKEN * shape.kv_dim) * b + n * qd * b + n * shape.heads * 4
    elif eager:
        # q and k after RoPE, v; transformers repeats k and v per query head when a padding mask is passed.
        saved += n * 3 * qd * b
        probs = n * shape.heads * seq  # [B, heads, T, T]: softmax in fp32, cast back for the product with v
        saved += probs * (4 + (b if b != 4 else 0))
    elif not flash:
        saved += n * 3 * qd * b
        # Output, log-sum-exp, and the padding mask as sdpa converts it to the model's dtype, once per layer.
        saved += n * qd * b + n * shape.heads * 4 + n * seq * b
    else:
        saved += n * (qd + 2 * shape.kv_dim) * b + n * qd * b + n * shape.heads * 4
    saved += 3 * n * i * b  # gate (SiLU's input), SiLU's output and up (both kept by their product)
    shapes = shape.linear_shapes()
    if b == 4:  # inputs kept once, whichever adapted modules read them
        if {"q_proj", "k_proj", "v_proj"} & set(targets):
            saved += n * h * 4
        if "o_proj" in targets and eager:
            saved += (
                n * qd * 4
            )  # eager's [B, T, heads x head_dim] copy; sdpa's output already has that layout
        if {"gate_proj", "up_proj"} & set(targets):
            saved += n * h * 4
        if "down_proj" in targets:
            saved += n * i * 4
    else:
        saved += sum(n * shapes[t][0] * 4 for t in targets)
    saved += len(targets) * n * cfg.lora.rank * 4  # lora_A outputs, kept for lora_B's gradient
    if shape.experts is not None and set(targets) & set(MLP_PROJECTIONS):
        saved += shape.experts.merged_weight_bytes(h)  # the MoE layer's experts with their deltas merged
    return saved


def compute_activation_bytes(shape: ModelShape, cfg: RunConfig, b: int, recomputed: int) -> dict[str, float]:
    """Peak bytes above weights, adapter, gradients and optimizer state during one micro-batch's forward and
    backward at trainer.micro_batch_tokens tokens (all of them trained: the worst case), with `recomputed` of the
    model's decoder layers under gradient checkpointing (0: none, shape.layers: every one)."""
    n = cfg.trainer.micro_batch_tokens
    h, i, L = shape.hidden, shape.mlp_width, shape.layers
    recomputed = max(0, min(recomputed, L))
    seq = min(cfg.trainer.max_seq_len, n)
    # Kept through the whole backward: the bool padding mask, the final norm's input, and the trained positions'
    # hidden states that the logprob chunks read (index_select's copy; packed, a shared prefix's trained rows are
    # read once per sequence, up to as many as the keys the attention reads).
    packed = cfg.trainer.micro_batch_layout == "packed"
    trained = n * (KEYS_PER_TOKEN if packed else 1)
    common = float(n * seq + (n * h * 4 + n * 4) + trained * h * b)
    if packed:
        common += n * seq * b  # the packed attention's additive mask, made once in the model's dtype
    layer = compute_layer_saved_bytes(shape, cfg, n, b, input_grad=True)
    # A checkpointed layer keeps its input; the others keep what their backward reads. Layer 0 (whose input needs
    # no gradient) is the last one checkpointing.spread_layers picks.
    kept = common + recomputed * n * h * b
    if recomputed < L:
        kept += (L - recomputed - 1) * layer + compute_layer_saved_bytes(shape, cfg, n, b, input_grad=False)
    layer_peak = kept
    if recomputed:
        # Backward recomputes one layer at a time: its saved tensors exist again while its gradients flow (over
        # an fp32 base, the first norm keeps the checkpointed input itself, already counted).
        layer_peak += layer - (n * h * 4 if b == 4 else 0)
    # Gradients in flight inside one layer's backward, at its largest step (the MLP): each kept input is freed as
    # its gradient appears, leaving one [n, intermediate] gradient ahead; over a bf16 base the LoRA path's fp32
    # gradient of its input copy comes on top. Plus the residual stream's gradient.
    layer_peak += n * i * (4 if b == 4 else 8) + 2 * n * h * b
    if shape.experts is not None and set(lora_targets(cfg)) & set(MLP_PROJECTIONS):
        layer_peak += shape.experts.merged_weight_bytes(
            h
        )  # the merged experts' gradient (or the forward's delta)
    chunk = min(cfg.trainer.logprob_chunk_tokens, n)
    # One chunk's fp32 logits while its backward runs: four [chunk, vocab] fp32 tensors at the worst moment (the
    # recomputed scaled logits kept by logsumexp, the softmax-shaped gradient, the gather's scattered gradient
    # and their sum); over bf16 the head's own output is freed once cast, before the backward's tensors appear.
    logits = chunk * shape.vocab * 4 * 4
    if "lm_head" in lora_targets(cfg):
        logits += chunk * (h * 4 + cfg.lora.rank * 4)
    logprob_peak = kept + n * h * b + logits  # last_hidden_state is alive during the forward's chunks
    return {"layers": float(layer_peak), "logprobs": float(logprob_peak), "kept": float(kept)}


def build_trainer_plan(
    shape: ModelShape, cfg: RunConfig, on_cuda: bool, teacher: ModelShape | None = None
) -> tuple[ProcessPlan, dict[str, int]]:
    """The trainer's peak on one rank, part by part; also the activation peak with checkpointing on and off."""
    dtype = trainer_dtype(cfg, on_cuda)
    b = dtype_bytes(dtype)
    lora_params, lora_tensors = lora_parameter_count(shape, cfg)
    by_mode = {}
    for checkpointing in (False, True):
        act = compute_activation_bytes(shape, cfg, b, shape.layers if checkpointing else 0)
        by_mode[checkpointing] = int(max(act["layers"], act["logprobs"]))
    recomputed = cfg.model.recomputed_layers(shape.layers, on_cuda)
    act = compute_activation_bytes(shape, cfg, b, recomputed)
    chosen = int(max(act["layers"], act["logprobs"]))
    plan = ProcessPlan()
    plan.add(f"base weights ({dtype})", shape.parameter_count() * b)
    plan.add("LoRA parameters (float32)", lora_params * 4, f"rank {cfg.lora.rank}")
    plan.add("LoRA gradients (float32)", lora_params * 4)
    plan.add("Adam moments (2 x float32)", 2 * lora_params * 4 + 4 * lora_tensors)
    if teacher is not None:
        plan.add(
            f"teacher model weights ({dtype})",
            teacher.parameter_count() * b,
            "distill.teacher, frozen; its no-grad forward runs before the step's, with fewer activations",
        )
    if cfg.distributed.world_size > 1:
        plan.add("DDP gradient buckets", lora_params * 4)
    plan.add(
        f"activations, {recomputed} of {shape.layers} layers recomputed",
        chosen,
        f"{cfg.trainer.micro_batch_tokens} tokens, logprob chunks of "
        f"{min(cfg.trainer.logprob_chunk_tokens, cfg.trainer.micro_batch_tokens)} x {shape.vocab} included; "
        f"no checkpointing: {by_mode[False] / GiB:.2f} GiB, every layer: {by_mode[True] / GiB:.2f} GiB",
    )
    if on_cuda:
        plan.add("CUDA context, workspaces, allocator slack", TRAINER_CUDA_ALLOWANCE, "an allowance")
    return plan, {"checkpointing_off": by_mode[False], "checkpointing_on": by_mode[True], "chosen": chosen}


@dataclass(frozen=True)
class VLLMSettings:
    """What the plan reads from the gateway's config, as `python -m inference.config` completes it (every key
    present); inference.samplers.vllm builds vLLM's argv from the same keys."""

    dtype: str
    max_lora_rank: int
    max_loras: int
    max_model_len: int | None
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    kv_cache_dtype: str | None
    enforce_eager: bool = False  # no CUDA graphs
    # What the slots hold: the versions kept behind the current one, and named adapters (eval).
    keep_versions: int = 0
    named_slots: int = 0
    # Graphs with and without LoRA active: the gateway turns this off on CUDA (every request carries a LoRA);
    # only a user's own --compilation-config in extra_args turns it back on.
    specialize_lora: bool = False

    @classmethod
    def from_gateway(cls, gateway: dict[str, Any]) -> VLLMSettings:
        v = gateway["vllm"]
        extra = [str(a) for a in v["extra_args"]]

        def flag(name: str) -> str | None:
            for k, arg in enumerate(extra):
                if arg == name and k + 1 < len(extra):
                    return extra[k + 1]
                if arg.startswith(name + "="):
                    return arg.split("=", 1)[1]
            return None

        batched, seqs = flag("--max-num-batched-tokens"), flag("--max-num-seqs")
        compilation = flag("--compilation-config") or "{}"
        try:
            specialize = bool(json.loads(compilation).get("cudagraph_specialize_lora", False))
        except (ValueError, AttributeError):
            specialize = False  # vLLM refuses what it cannot parse, with its own message
        keep, named = int(gateway["keep_versions"]), int(gateway.get("named_slots") or 0)
        return cls(
            dtype=str(v["dtype"]),
            max_lora_rank=int(v["max_lora_rank"]),
            # vLLM's --max-loras, as the gateway passes it
            max_loras=lora_slots(keep) + named,
            max_model_len=v["max_model_len"],
            gpu_memory_utilization=v["gpu_memory_utilization"],
            kv_cache_memory_bytes=v["kv_cache_memory_bytes"],
            max_num_batched_tokens=int(batched) if batched else None,
            max_num_seqs=int(seqs) if seqs else None,
            kv_cache_dtype=flag("--kv-cache-dtype"),
            enforce_eager=bool(v.get("enforce_eager")) or "--enforce-eager" in extra,
            keep_versions=keep,
            named_slots=named,
            specialize_lora=specialize,
        )

    def slot_parts(self) -> str:
        """What vLLM's --max-loras slots hold (rlcommon/slots.py), and its --max-cpu-loras."""
        named = f" + {self.named_slots} named (eval)" if self.named_slots else ""
        return (
            f"{self.keep_versions} kept + current + publishing + base-zero-lora{named}; "
            f"--max-cpu-loras {self.max_loras}"
        )


def build_vllm_plan(
    shape: ModelShape, cfg: RunConfig, v: VLLMSettings, gpu_bytes: int | None, on_cuda: bool = True
) -> tuple[ProcessPlan, dict[str, int]]:
    """vLLM's share of a GPU: inside its budget weights, LoRA slots (preallocated for max_loras adapters at
    max_lora_rank in every linear layer), its profiling run's activations, its CUDA-graph estimate, an allowance,
    and the KV cache that is left; outside it, the CUDA context."""
    dtype = v.dtype if v.dtype != "auto" else str(shape.dtype or "bfloat16")
    b = dtype_bytes(dtype)
    plan = ProcessPlan()
    plan.add(f"weights ({dtype})", shape.parameter_count() * b)
    shapes = shape.linear_shapes()
    slot_modules = [m for m in ALL_LINEAR] + (["lm_head"] if "lm_head" in lora_targets(cfg) else [])

    def layers_of(m: str) -> int:
        return 1 if m == "lm_head" else shape.dense_layers if m in MLP_PROJECTIONS else shape.layers

    per_slot = sum(layers_of(m) * v.max_lora_rank * sum(shapes[m]) for m in slot_modules)
    note = f"{v.max_loras} x rank {v.max_lora_rank} ({v.slot_parts()})"
    if shape.experts is not None:
        # vLLM's fused-MoE LoRA buffers: every expert's gate, up and down A and B at max_lora_rank, per slot.
        e = shape.experts
        per_slot += e.layers * e.count * v.max_lora_rank * 3 * (shape.hidden + e.intermediate)
        note += f"; experts: {e.count} per layer in {e.layers} layers"
    plan.add("LoRA slots", v.max_loras * per_slot * b, note)
    big_gpu = gpu_bytes is not None and gpu_bytes >= 70 * GiB
    tokens = v.max_num_batched_tokens or (8192 if big_gpu else 2048)  # vLLM's server defaults (not A100s)
    seqs = v.max_num_seqs or (1024 if big_gpu else 256)
    # The profiling run: one layer's widest tensors at `tokens`, and fp32 logits (and probabilities) of the
    # sampled positions. An estimate; vLLM measures its own and sizes the KV cache from what it saw.
    plan.add(
        "activations (profiling run)",
        widest_layer_bytes(shape, tokens, b) + 2 * seqs * shape.vocab * 4,
        f"{tokens} tokens, {seqs} seqs",
    )
    # The gateway always starts vLLM with --enable-lora; vLLM's CPU platform captures no graphs.
    graphs = count_cuda_graphs(v, seqs, tokens, lora=True) if on_cuda else (0, 0)
    each = "without and with LoRA" if v.specialize_lora else "once, LoRA active"
    plan.add(
        "CUDA graphs (vLLM's estimate)",
        cuda_graph_bytes(shape, b, graphs, seqs, tokens),
        f"{sum(graphs)} graphs: each batch size {each}" if sum(graphs) else "none captured",
    )
    plan.add("non-torch workspaces (allowance)", VLLM_RUNTIME_ALLOWANCE)
    kv_b = 1 if (v.kv_cache_dtype or "").startswith("fp8") else b
    per_token = 2 * shape.layers * shape.kv_dim * kv_b
    max_len = v.max_model_len or shape.max_positions or cfg.rollout.max_token_length
    one_seq = blocks(max_len) * per_token
    fixed = plan.total
    if v.kv_cache_memory_bytes is not None:
        kv = v.kv_cache_memory_bytes
        budget = fixed + kv
    elif gpu_bytes is not None:
        budget = int(gpu_bytes * (v.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION))
        kv = budget - fixed
    else:
        kv, budget = 0, 0
    kv_tokens = max(kv, 0) // (per_token * VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS  # whole blocks only
    if v.kv_cache_memory_bytes is not None or gpu_bytes is not None:
        note = f"{kv_tokens} tokens = {kv_tokens / blocks(max_len):.1f} x max_model_len {max_len}"
        plan.add("KV cache", kv, note)
    plan.add("CUDA context, NCCL (allowance)", VLLM_CONTEXT_ALLOWANCE, "outside the utilization budget")
    # A step samples groups_per_step x group_size sequences; each holds KV for its prompt and completion, which the
    # environment caps at rollout.max_token_length (and vLLM at max_model_len): the worst case, prompts unknown here.
    sequence = min(cfg.rollout.max_token_length, max_len)
    return plan, {
        "budget": budget,  # --gpu-memory-utilization x the GPU (or what kv_cache_memory_bytes implies)
        "share": budget + VLLM_CONTEXT_ALLOWANCE,  # what vLLM holds on its GPU
        "kv": kv,
        "kv_tokens": kv_tokens,
        "one_sequence": one_seq,
        "fixed": fixed,
        "max_len": max_len,
        "graphs": sum(graphs),
        "step_sequences": cfg.rollout.batch_size,
        "groups": cfg.rollout.groups_per_step,
        "group_size": cfg.rollout.group_size,
        "sequence_tokens": sequence,
        "sequences_at_once": kv_tokens // blocks(sequence),
    }


def blocks(tokens: int) -> int:
    """Tokens of KV cache a sequence of `tokens` occupies: vLLM allocates whole blocks."""
    return -(-tokens // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS


def widest_layer_bytes(shape: ModelShape, tokens: int, b: int) -> int:
    """One decoder layer's widest live tensors in an inference forward over `tokens` tokens."""
    return tokens * (2 * shape.mlp_width + shape.q_dim + 2 * shape.kv_dim + 2 * shape.hidden) * b


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Batch sizes (tokens) vLLM 0.32 captures CUDA graphs for by default (VllmConfig's capture-size rule, one
    token per decode step): 1, 2, 4, multiples of 8 below 256 and of 16 from 256, up to min(2 x max_num_seqs, 512,
    max_num_batched_tokens); plus max_num_batched_tokens and max_num_seqs where they are under that ceiling."""
    first = min(2 * max_num_seqs, VLLM_MAX_GRAPH_TOKENS)
    ceiling = min(first, max_num_batched_tokens)
    sizes = {s for s in (1, 2, 4) if s <= ceiling}
    sizes |= set(range(8, min(ceiling + 1, 256), 8)) | set(range(256, ceiling + 1, 16))
    if max_num_batched_tokens <= first:
        sizes.add(max_num_batched_tokens)
    if max_num_seqs <= first and max_num_seqs <= max_num_batched_tokens:
        sizes.add(max_num_seqs)  # the widest uniform decode batch
    return sorted(sizes)


def count_cuda_graphs(v: VLLMSettings, seqs: int, tokens: int, lora: bool) -> tuple[int, int]:
    """(PIECEWISE, FULL) graphs vLLM 0.32 captures in its default FULL_AND_PIECEWISE mode: mixed batches at every
    capture size, decode-only batches at those up to max_num_seqs (vllm/v1/cudagraph_dispatcher.py). With LoRA
    and cudagraph_specialize_lora (vLLM's default, which the gateway turns off on CUDA) each is captured twice,
    without and with adapters active."""
    if v.enforce_eager:
        return 0, 0
    sizes = capture_sizes(seqs, tokens)
    cases = 2 if lora and v.specialize_lora else 1
    return len(sizes) * cases, sum(1 for s in sizes if s <= seqs) * cases


def cuda_graph_bytes(shape: ModelShape, b: int, graphs: tuple[int, int], seqs: int, tokens: int) -> int:
    """vLLM's CUDA-graph estimate: the largest capture's activations (graphs share one memory pool, so this is
    counted once) plus VLLM_GRAPH_BYTES for every other graph of each mode."""
    if not sum(graphs):
        return 0
    largest = capture_sizes(seqs, tokens)[-1]
    return widest_layer_bytes(shape, largest, b) + VLLM_GRAPH_BYTES * sum(max(n - 1, 0) for n in graphs)


@dataclass
class MemoryPlan:
    shape: ModelShape
    trainer: ProcessPlan
    activations: dict[str, int]  # the trainer's activation peak with checkpointing off and on
    vllm: ProcessPlan | None  # None when Tinker samples
    vllm_facts: dict[str, int]
    gpu_bytes: int | None  # per GPU: stated (launch.gpu_memory_gib) or read from the device
    on_cuda: bool
    shared_replicas: int  # vLLM replicas on a GPU the trainer also uses


def count_shared_replicas(cfg: RunConfig, gateway: dict[str, Any]) -> int:
    """vLLM replicas placed on a GPU one of the trainer's ranks uses, by CUDA_VISIBLE_DEVICES entries (unset =
    device 0 for vLLM, devices 0..nproc_per_node-1 for the trainer). Under SLURM the gateway and the trainer's
    first ranks share the first node, so the same comparison holds there."""
    if cfg.distributed.devices:
        trainer = {d.strip() for d in cfg.distributed.devices.split(",")}
    else:
        trainer = {str(k) for k in range(cfg.distributed.nproc_per_node)}
    v = gateway["vllm"]
    devices = v["replica_devices"] or ["0"] * int(v["replicas"])
    return sum(1 for d in devices if {x.strip() for x in str(d).split(",")} & trainer)


def build_memory_plan(
    cfg: RunConfig,
    model_config: dict[str, Any],
    gateway: dict[str, Any] | None,
    gpu_bytes: int | None,
    on_cuda: bool,
    teacher_config: dict[str, Any] | None = None,
) -> MemoryPlan:
    shape = ModelShape.from_config(model_config)
    teacher = ModelShape.from_config(teacher_config) if teacher_config is not None else None
    trainer, activations = build_trainer_plan(shape, cfg, on_cuda, teacher)
    vllm: ProcessPlan | None = None
    facts: dict[str, int] = {}
    shared = 0
    if gateway is not None and cfg.launch.backend == "local":
        vllm, facts = build_vllm_plan(shape, cfg, VLLMSettings.from_gateway(gateway), gpu_bytes, on_cuda)
        shared = count_shared_replicas(cfg, gateway)
    return MemoryPlan(shape, trainer, activations, vllm, facts, gpu_bytes, on_cuda, shared)


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def check_fit(plan: MemoryPlan, cfg: RunConfig, gateway: dict[str, Any] | None) -> list[str]:
    """Why the config cannot fit its GPUs, one problem per line naming the knobs; empty when it fits or when
    nothing is known to check (no CUDA, or no GPU size)."""
    if not plan.on_cuda or plan.gpu_bytes is None:
        return []
    gpu, problems = plan.gpu_bytes, []
    vllm_share = 0
    if plan.vllm is not None and gateway is not None:
        f, v = plan.vllm_facts, VLLMSettings.from_gateway(gateway)
        vllm_share = f["share"]
        if v.kv_cache_memory_bytes is None:
            util = v.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
            if f["kv"] < f["one_sequence"]:
                need = (f["fixed"] + f["one_sequence"]) / gpu
                problems.append(
                    f"vLLM needs {gib(f['fixed'])} before its KV cache plus {gib(f['one_sequence'])} for one "
                    f"max_model_len={f['max_len']} sequence, but inference.vllm.gpu_memory_utilization={util} "
                    f"gives it {gib(f['budget'])} of the {gib(gpu)} GPU: raise it to at least {need:.2f}, or lower "
                    "inference.vllm.max_model_len (or inference.keep_versions / inference.vllm.max_lora_rank "
                    "for fewer, smaller LoRA slots)"
                )
        elif f["kv"] < f["one_sequence"]:
            problems.append(
                f"inference.vllm.kv_cache_memory_bytes={f['kv']} holds less than one max_model_len={f['max_len']} "
                f"sequence ({f['one_sequence']} bytes): raise it, or lower inference.vllm.max_model_len"
            )
        if not plan.shared_replicas and f["share"] > gpu:
            problems.append(f"vLLM needs {gib(f['share'])} on a {gib(gpu)} GPU")
    left = gpu - plan.shared_replicas * vllm_share
    if plan.trainer.total > left:
        where = (
            f"vLLM takes {gib(plan.shared_replicas * vllm_share)} of the {gib(gpu)} GPU it shares with the "
            f"trainer, leaving {gib(left)}"
            if plan.shared_replicas
            else f"its GPU has {gib(gpu)}"
        )
        problems.append(
            f"the trainer needs {gib(plan.trainer.total)} but {where}: "
            + "; ".join(trainer_fixes(plan, cfg, gateway))
        )
    return problems


def trainer_fixes(plan: MemoryPlan, cfg: RunConfig, gateway: dict[str, Any] | None) -> list[str]:
    """Knobs that would make the trainer fit, each with the value that does it where one exists."""
    assert plan.gpu_bytes is not None
    gpu, fixes = plan.gpu_bytes, []
    act_now = plan.activations["chosen"]
    others = plan.trainer.total - act_now
    left = gpu - plan.shared_replicas * plan.vllm_facts.get("share", 0)
    if cfg.model.recomputed_layers(plan.shape.layers, plan.on_cuda) < plan.shape.layers:
        verdict = "fits" if others + plan.activations["checkpointing_on"] <= left else "not enough alone"
        fixes.append(
            f"set model.gradient_checkpointing=true or auto (activations "
            f"{gib(plan.activations['checkpointing_on'])} with every layer recomputed, instead of "
            f"{gib(act_now)}: {verdict})"
        )
    best = largest_fitting_micro_batch(plan, cfg, left)
    if best is not None:
        fixes.append(
            f"lower trainer.micro_batch_tokens from {cfg.trainer.micro_batch_tokens} to {best} or less"
        )
    else:
        fixes.append(
            f"lower trainer.max_seq_len ({cfg.trainer.max_seq_len}; micro-batches of one sequence do not fit) "
            "or trainer.logprob_chunk_tokens"
        )
    v = VLLMSettings.from_gateway(gateway) if gateway is not None else None
    if plan.shared_replicas and v is not None and v.kv_cache_memory_bytes is None:
        # The utilization share that leaves the trainer its room; each replica's context comes on top.
        for_budgets = gpu - plan.trainer.total - plan.shared_replicas * VLLM_CONTEXT_ALLOWANCE
        room = for_budgets / gpu / plan.shared_replicas
        if gpu * room >= plan.vllm_facts["fixed"] + plan.vllm_facts["one_sequence"]:
            fixes.append(f"lower inference.vllm.gpu_memory_utilization to {room:.2f} or less")
    if plan.shared_replicas:
        fixes.append("or give vLLM its own GPU (inference.vllm.replica_devices, distributed.devices)")
    return fixes


# What checkpointing auto leaves free of the trainer's share: the plan's error (within a few percent of CPU
# measurements, tests/unit/test_memory_plan.py) and the CUDA allocator's fragmentation.
AUTO_CHECKPOINTING_MARGIN = 0.10


def choose_recomputed_layers(plan: MemoryPlan, cfg: RunConfig) -> tuple[int, str]:
    """model.gradient_checkpointing auto: the fewest decoder layers to recompute whose trainer peak fits the
    trainer's share of its GPU (what shared vLLM replicas leave), and the sentence that says why."""
    L = plan.shape.layers
    if not plan.on_cuda:
        return 0, "gradient checkpointing auto: none (on CPU memory is not planned)"
    if plan.gpu_bytes is None:
        return (
            L,
            "gradient checkpointing auto: every layer (GPU size unknown; launch.gpu_memory_gib=N plans it)",
        )
    left = plan.gpu_bytes - plan.shared_replicas * plan.vllm_facts.get("share", 0)
    room = left * (1 - AUTO_CHECKPOINTING_MARGIN)
    others = plan.trainer.total - plan.activations["chosen"]
    b = dtype_bytes(trainer_dtype(cfg, plan.on_cuda))

    def peak(recomputed: int) -> int:
        act = compute_activation_bytes(plan.shape, cfg, b, recomputed)
        return int(max(act["layers"], act["logprobs"]))

    none = peak(0)
    for count in range(L + 1):
        if others + peak(count) <= room:
            what = "none" if count == 0 else "every layer" if count == L else f"{count} of {L} layers"
            return count, (
                f"gradient checkpointing auto: {what} recomputed, the least that fits: trainer "
                f"{gib(others + peak(count))} of the {gib(left)} it has, {AUTO_CHECKPOINTING_MARGIN:.0%} kept "
                f"free (no checkpointing would need {gib(others + none)})"
            )
    return L, (
        f"gradient checkpointing auto: every layer recomputed, and even so the trainer needs "
        f"{gib(others + peak(L))} of the {gib(left)} it has"
    )


def largest_fitting_micro_batch(plan: MemoryPlan, cfg: RunConfig, left: int) -> int | None:
    """The largest trainer.micro_batch_tokens (>= max_seq_len, in steps of 256) whose plan fits in `left`."""
    others = plan.trainer.total - max(plan.activations["chosen"], 0)
    b = dtype_bytes(trainer_dtype(cfg, plan.on_cuda))
    recomputed = cfg.model.recomputed_layers(plan.shape.layers, plan.on_cuda)

    def fits(tokens: int) -> bool:
        trial = cfg.model_copy(deep=True)
        trial.trainer.micro_batch_tokens = tokens
        act = compute_activation_bytes(plan.shape, trial, b, recomputed)
        return others + max(act["layers"], act["logprobs"]) <= left

    lo, hi = cfg.trainer.max_seq_len, cfg.trainer.micro_batch_tokens
    if not fits(lo):
        return None
    while hi - lo > 256:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo // 256 * 256 if lo >= 256 else lo


def format_plan(plan: MemoryPlan, gpu_source: str) -> list[str]:
    """The plan as a table: part, GiB, note."""
    s = plan.shape
    e = s.experts
    mlp = f"intermediate {s.intermediate}"
    if e is not None:
        mlp = f"{e.count} experts of {e.intermediate} ({e.per_token} per token) in {e.layers} layers"
        mlp += f", dense intermediate {s.intermediate} in {s.dense_layers}" if s.dense_layers else ""
    lines = [
        f"memory plan (GiB = 2^30 bytes; model: {s.layers} layers, hidden {s.hidden}, {mlp}, "
        f"{s.heads}/{s.kv_heads} heads, vocab {s.vocab}; {s.parameter_count() / 1e9:.2f}B parameters)"
    ]
    sections = [("trainer, per rank", plan.trainer)]
    if plan.vllm is not None:
        sections.append(("vLLM, per replica", plan.vllm))
    for title, proc in sections:
        lines.append(f"  {title}:")
        for p in proc.parts:
            lines.append(f"    {p.name:<46}{p.bytes / GiB:>9.2f}" + (f"   {p.note}" if p.note else ""))
        lines.append(f"    {'total':<46}{proc.total / GiB:>9.2f}")
    if not plan.on_cuda:
        lines.append("  on CPU: the plan is for information; nothing is checked")
    elif plan.gpu_bytes is None:
        lines.append("  GPU size unknown (no GPU here): state launch.gpu_memory_gib=80 to check the fit")
    else:
        vllm = plan.shared_replicas * (plan.vllm_facts.get("share", 0))
        shared = f" + vLLM {gib(vllm)} ({plan.shared_replicas} replica(s) on the same GPU)" if vllm else ""
        lines.append(
            f"  on one {gib(plan.gpu_bytes)} GPU ({gpu_source}): trainer {gib(plan.trainer.total)}{shared} = "
            f"{gib(plan.trainer.total + vllm)}, {gib(max(plan.gpu_bytes - plan.trainer.total - vllm, 0))} unused"
        )
    if plan.vllm is not None and any(p.name == "KV cache" for p in plan.vllm.parts):
        lines.append(format_kv_capacity(plan.vllm_facts))
    return lines


def format_kv_capacity(f: dict[str, int]) -> str:
    """How much sampling the KV cache holds at once: tokens, max_model_len sequences, and a step's sequences at
    their length limit (the worst case; prompts are shorter than the limit in most environments)."""
    step = f["step_sequences"]
    return (
        f"  vLLM KV cache per replica: {f['kv_tokens']} tokens = {f['kv_tokens'] / blocks(f['max_len']):.1f} "
        f"sequences of max_model_len {f['max_len']}; a step samples {step} sequences ({f['groups']} groups x "
        f"{f['group_size']}) of up to {f['sequence_tokens']} tokens (rollout.max_token_length, prompt + "
        f"completion): {f['sequences_at_once']} fit at once = {f['sequences_at_once'] / step:.2f} step batches"
    )


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
