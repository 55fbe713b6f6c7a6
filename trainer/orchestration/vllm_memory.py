"""vLLM's share of a GPU in the memory plan: weights, LoRA slots, its profiling run, CUDA graphs, the KV cache
its budget leaves, as vLLM 0.32 sizes them (read from its source; no GPU with vLLM has measured them here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlcommon.lora_slots import lora_slots
from trainer.orchestration.model_shape import (
    ALL_LINEAR,
    MLP_PROJECTIONS,
    GiB,
    ModelShape,
    ProcessPlan,
    dtype_bytes,
    lora_targets,
)
from trainer.training.config import RunConfig

# Allowances, not derived: vLLM 0.32 takes its start-up snapshot after its CUDA context and NCCL exist
# (vllm/v1/worker/gpu_worker.py init_device), so those sit outside its --gpu-memory-utilization budget; the non-torch
# memory it allocates later (cuBLAS and attention workspaces) sits inside. Round numbers to keep a margin.
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
class VLLMSettings:
    """What the plan reads from the gateway's config, as `python -m inference.config` completes it (every key
    present); inference.samplers.vllm_command builds vLLM's argv from the same keys."""

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
        """What vLLM's --max-loras slots hold (rlcommon/lora_slots.py), and its --max-cpu-loras."""
        named = f" + {self.named_slots} named (eval)" if self.named_slots else ""
        return (
            f"{self.keep_versions} kept + current + publishing + base-zero-lora{named}; "
            f"--max-cpu-loras {self.max_loras}"
        )


def lora_slot(shape: ModelShape, cfg: RunConfig, v: VLLMSettings) -> tuple[int, str]:
    """Values one of vLLM's LoRA slots preallocates (every linear layer at max_lora_rank, and every expert's on an
    MoE model), and the plan's note on the slots."""
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
    return per_slot, note


def kv_budget(v: VLLMSettings, fixed: int, gpu_bytes: int | None) -> tuple[int, int]:
    """(KV cache bytes, vLLM's budget): what kv_cache_memory_bytes sets, else the utilization share of the GPU less
    what is fixed; (0, 0) with neither known."""
    if v.kv_cache_memory_bytes is not None:
        return v.kv_cache_memory_bytes, fixed + v.kv_cache_memory_bytes
    if gpu_bytes is not None:
        budget = int(gpu_bytes * (v.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION))
        return budget - fixed, budget
    return 0, 0


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
    per_slot, note = lora_slot(shape, cfg, v)
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
    kv, budget = kv_budget(v, fixed, gpu_bytes)
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
