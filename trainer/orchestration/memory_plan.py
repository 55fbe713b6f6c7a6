"""Expected peak GPU memory of a run config, for the trainer and for vLLM, and whether they fit one GPU.

Pure arithmetic on the run config and the model's config.json (a Llama/Qwen/Mistral-style decoder, model_shape.py):
no torch, no GPU, no network. vLLM's share is planned in vllm_memory.py. The launcher prints the plan on --dry-run and refuses, before anything starts, a CUDA config
that cannot fit, naming the knob to turn. The activation terms count the tensors autograd keeps for the code as
it is (trainer/backends/local.py, trainer/training/logprobs.py, PEFT's LoRA Linear, transformers' Llama layers);
tests/unit/test_memory_plan.py checks them against measured peaks on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.orchestration.model_shape import (
    MLP_PROJECTIONS,
    GiB,
    ModelShape,
    ProcessPlan,
    dtype_bytes,
    lora_targets,
)
from trainer.orchestration.vllm_memory import (
    VLLM_CONTEXT_ALLOWANCE,
    VLLM_DEFAULT_UTILIZATION,
    VLLMSettings,
    blocks,
    build_vllm_plan,
)
from trainer.training.config import RunConfig
from trainer.training.packing import KEYS_PER_TOKEN

# An allowance, not derived: a CUDA context with torch's kernels loaded (~0.5 GiB on an H100), cuBLAS workspaces and
# the caching allocator's rounding and fragmentation for the trainer; a round number to keep a margin.
TRAINER_CUDA_ALLOWANCE = 1 * GiB


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
