"""The memory plan (trainer/orchestration/memory_plan.py) against memory measured on CPU: a small random Llama
through the real LocalBackend, one micro-batch's forward and backward, peak bytes from the profiler's allocation
events. Also the exact parts (weights, adapter, Adam), and the launcher's dry-run table and refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from trainer.backends.local import LocalBackend
from trainer.orchestration.memory_plan import (
    build_memory_plan,
    build_trainer_plan,
    check_fit,
    compute_activation_bytes,
    lora_parameter_count,
)
from trainer.orchestration.model_shape import GiB, ModelShape
from trainer.training.backend import AdamParams
from trainer.training.batch import TrainingExample
from trainer.training.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def cpu_peak_bytes(fn: Any) -> int:
    """Peak of bytes allocated by `fn` above what was allocated before it: the running sum of the CPU allocator's
    alloc (+) and free (-) events that the profiler records in order. Frees of older tensors count as negative,
    so the peak is of live memory, not of new allocations alone."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_cpu_peak_bytes_measures_live_memory():
    def work() -> None:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(3 << 20, dtype=torch.uint8)
        del a, b
        c = torch.empty(2 << 20, dtype=torch.uint8)
        del c

    assert cpu_peak_bytes(work) == 4 << 20


def small_cfg(tmp_path: Path, shape: dict[str, Any], **over: Any) -> RunConfig:
    data: dict[str, Any] = {
        "model": {
            "path": "unused",
            "device": "cpu",
            "dtype": over.get("dtype", "float32"),
            "gradient_checkpointing": over.get("gc", False),
            "attn_implementation": over.get("attn"),
        },
        "lora": {"rank": 8, "target_modules": over.get("targets", "all-linear")},
        "trainer": {
            "output_dir": str(tmp_path),
            "max_seq_len": shape["T"],
            "micro_batch_tokens": shape["B"] * shape["T"],
            "logprob_chunk_tokens": over.get("chunk", 256),
            "micro_batch_layout": over.get("layout", "packed"),
        },
    }
    return RunConfig.model_validate(data)


def build_backend(cfg: RunConfig, shape: dict[str, Any]) -> tuple[LocalBackend, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape["V"],
        hidden_size=shape["h"],
        intermediate_size=shape["I"],
        num_hidden_layers=shape["L"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["h"] // shape["heads"],
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, cfg.model.dtype))
    if cfg.model.attn_implementation:
        model.config._attn_implementation = cfg.model.attn_implementation
    return LocalBackend(cfg, model=model), config.to_dict()


def padded_batch(shape: dict[str, Any]) -> list[TrainingExample]:
    """B sequences, the longest T tokens, the others a little shorter (so a padding mask is passed, as in a run)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for b in range(shape["B"]):
        n = shape["T"] - 8 * b
        ids = torch.randint(0, shape["V"], (n,), generator=g).tolist()
        out.append(TrainingExample(ids, ids, [1.0] * n, [-1.0] * n, [0.5] * n))
    return out


def full_packed_batch(shape: dict[str, Any], shared: int) -> list[TrainingExample]:
    """The packed layout's worst case: sequences of T tokens whose computed tokens fill the budget (B x T); with
    `shared` > 0, each shares its first `shared` tokens with the others, so the attention also reads nearly
    KEYS_PER_TOKEN keys per computed token (packing.KEYS_PER_TOKEN)."""
    g = torch.Generator().manual_seed(1)
    budget, T = shape["B"] * shape["T"], shape["T"]
    count = (budget - shared) // (T - shared) if shared else shape["B"]
    prefix = torch.randint(0, shape["V"], (shared,), generator=g).tolist()
    out = []
    for _ in range(count):
        ids = prefix + torch.randint(0, shape["V"], (T - shared,), generator=g).tolist()
        out.append(TrainingExample(ids, ids, [1.0] * T, [-1.0] * T, [0.5] * T))
    return out


BASE = {"h": 256, "I": 688, "L": 4, "heads": 4, "kv": 2, "V": 4096, "B": 4, "T": 256}
CASES = {
    "fp32": ({}, {}),
    "fp32-checkpointing": ({}, {"gc": True}),
    "fp32-checkpointing-8-layers": ({"L": 8, "V": 8192}, {"gc": True}),
    "fp32-checkpointing-wide": ({"h": 512, "I": 1376, "heads": 8, "kv": 4}, {"gc": True}),
    "fp32-wide-mha": ({"h": 512, "I": 1376, "heads": 8, "kv": 8}, {}),
    "fp32-big-chunk": ({}, {"chunk": 1024}),
    "fp32-qv-only": ({}, {"targets": ["q_proj", "v_proj"]}),
    "fp32-lm-head-lora": ({}, {"targets": ["q_proj", "v_proj", "down_proj", "lm_head"]}),
    "fp32-eager": ({}, {"attn": "eager"}),
    "bf16": ({"h": 128, "I": 352, "B": 8, "T": 128}, {"dtype": "bfloat16"}),
    "bf16-checkpointing": ({"h": 128, "I": 352, "B": 8, "T": 128}, {"dtype": "bfloat16", "gc": True}),
    "fp32-shared-prefix": ({}, {"shared": 128}),
    "bf16-shared-prefix": ({"h": 128, "I": 352, "B": 8, "T": 128}, {"dtype": "bfloat16", "shared": 64}),
    "fp32-padded": ({}, {"layout": "padded"}),
    "fp32-padded-eager": ({}, {"attn": "eager", "layout": "padded"}),
    "bf16-padded": ({"h": 128, "I": 352, "B": 8, "T": 128}, {"dtype": "bfloat16", "layout": "padded"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_activation_peak_matches_cpu_measurement(tmp_path, case):
    shape_over, cfg_over = CASES[case]
    shape = {**BASE, **shape_over}
    cfg = small_cfg(tmp_path, shape, **cfg_over)
    backend, config = build_backend(cfg, shape)
    if cfg.trainer.micro_batch_layout == "padded":
        examples = padded_batch(shape)
    else:
        examples = full_packed_batch(shape, cfg_over.get("shared", 0))
    loss = cfg.loss.params()
    # Warm-up on one sequence: lazily built kernels and caches are not the plan's. (A full-size warm-up measured the
    # same peak to the byte in every case here, at four times the cost.)
    backend.forward_backward(examples[:1], loss)
    backend.optimizer.zero_grad(set_to_none=True)
    measured = cpu_peak_bytes(lambda: backend.forward_backward(examples, loss))

    model_shape = ModelShape.from_config(config)
    recomputed = cfg.model.recomputed_layers(model_shape.layers, on_cuda=False)
    act = compute_activation_bytes(model_shape, cfg, 4 if cfg.model.dtype == "float32" else 2, recomputed)
    lora_params, _ = lora_parameter_count(model_shape, cfg)
    predicted = max(act["layers"], act["logprobs"]) + 4 * lora_params  # the gradients appear during backward
    error = predicted / measured - 1
    print(
        f"{case}: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB ({error:+.1%})"
    )
    assert abs(error) < 0.15, f"{case}: measured {measured}, predicted {predicted} ({error:+.1%})"


def test_weights_adapter_and_adam_parts_are_exact(tmp_path):
    shape = {**BASE, "L": 2}
    cfg = small_cfg(tmp_path, shape, targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "lm_head"])
    backend, config = build_backend(cfg, shape)
    adam = AdamParams(
        learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0
    )
    backend.train_step(padded_batch(shape), cfg.loss.params(), "sum", adam)
    plan, _ = build_trainer_plan(ModelShape.from_config(config), cfg, on_cuda=False)
    parts = {p.name: p.bytes for p in plan.parts}

    base = sum(p.numel() * p.element_size() for p in backend.model.parameters() if not p.requires_grad)
    lora = sum(p.numel() * p.element_size() for p in backend.model.parameters() if p.requires_grad)
    adam_state = sum(
        t.numel() * t.element_size()
        for s in backend.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    assert parts["base weights (float32)"] == base
    assert parts["LoRA parameters (float32)"] == parts["LoRA gradients (float32)"] == lora
    assert parts["Adam moments (2 x float32)"] == adam_state


def gateway_for(cfg: RunConfig) -> dict[str, Any]:
    from inference.config import GatewayConfig

    section = {
        **cfg.inference,
        "keep_versions": cfg.inference.get("keep_versions", cfg.rollout.max_staleness),
    }
    return GatewayConfig.model_validate(section).model_dump(mode="json")


def test_the_reference_run_fits_an_80_gib_gpu_and_is_refused_on_40_naming_the_knobs():
    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml")
    gateway = gateway_for(cfg)
    fits = build_memory_plan(cfg, LLAMA_8B, gateway, 80 * GiB, on_cuda=True)
    assert check_fit(fits, cfg, gateway) == []
    assert fits.shared_replicas == 1 and 20 * GiB < fits.trainer.total < 40 * GiB

    small = build_memory_plan(cfg, LLAMA_8B, gateway, 40 * GiB, on_cuda=True)
    problems = "\n".join(check_fit(small, cfg, gateway))
    for knob in ("inference.vllm.gpu_memory_utilization=0.35", "trainer.micro_batch_tokens", "max_model_len"):
        assert knob in problems, problems

    off = cfg.model_copy(deep=True)
    off.model.gradient_checkpointing = False
    problems = "\n".join(
        check_fit(build_memory_plan(off, LLAMA_8B, gateway, 80 * GiB, on_cuda=True), off, gateway)
    )
    assert "set model.gradient_checkpointing=true or auto" in problems, problems


def test_separate_gpus_are_checked_each_on_its_own():
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "gsm8k.yaml",
        [
            "distributed.devices='1'",
            "inference.vllm.replica_devices=['0']",
            "inference.vllm.gpu_memory_utilization=0.9",
        ],
    )
    gateway = gateway_for(cfg)
    plan = build_memory_plan(cfg, LLAMA_8B, gateway, 80 * GiB, on_cuda=True)
    assert plan.shared_replicas == 0 and check_fit(plan, cfg, gateway) == []


def test_a_cpu_run_is_planned_but_never_refused():
    cfg = load_config(RunConfig, ROOT / "configs" / "tiny_cpu.yaml", ["launch.gpu_memory_gib=0.001"])
    from trainer.orchestration.preflight import plan_memory

    lines, problems = plan_memory(cfg, "tiny", gateway_for(cfg), dry_run=False)
    assert problems == [] and any("on CPU" in line for line in lines)


def write_model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "llama-8b-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return folder


def test_dry_run_prints_the_plan_and_exits_2_when_a_stated_gpu_is_too_small(tmp_path, capsys):
    from trainer.orchestration.launcher import main

    folder = write_model_folder(tmp_path)
    args = ["gsm8k", "--dry-run", f"model.path={folder}", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main([*args, "launch.gpu_memory_gib=80"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "# memory plan",
        "base weights (bfloat16)",
        "Adam moments",
        "activations, ",
        "layers recomputed",
        "gradient checkpointing auto: ",
        "KV cache",
        "LoRA slots",
        "CUDA graphs (vLLM's estimate)",
        "on one 80.00 GiB GPU",
        "vLLM KV cache per replica:",
        "step batches",
        "3 kept + current + publishing + base-zero-lora + 1 named (eval); --max-cpu-loras 7",
        "vLLM shares its GPU with the trainer: --kv-cache-memory-bytes ",
    ):
        assert needle in out, needle
    assert main([*args, "launch.gpu_memory_gib=40"]) == 2
    assert "trainer.micro_batch_tokens" in capsys.readouterr().err


def test_a_real_launch_refuses_before_starting_anything(tmp_path):
    from trainer.orchestration.launcher import check_memory

    folder = write_model_folder(tmp_path)
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "gsm8k.yaml",
        ["model.device=cuda", "launch.gpu_memory_gib=24", f"trainer.output_dir={tmp_path / 'run'}"],
    )
    with pytest.raises(ConfigError, match="does not fit its GPU") as err:
        check_memory(cfg, str(folder))
    assert "inference.vllm.gpu_memory_utilization" in str(err.value)
    assert not (tmp_path / "run").exists()


def test_the_default_utilization_is_vllm_0_32s_own():
    import importlib.util
    import re

    from trainer.orchestration.vllm_memory import VLLM_DEFAULT_UTILIZATION

    cfg = load_config(
        RunConfig, ROOT / "configs" / "gsm8k.yaml", ["inference.vllm.gpu_memory_utilization=null"]
    )
    plan = build_memory_plan(cfg, LLAMA_8B, gateway_for(cfg), 80 * GiB, on_cuda=True)
    assert VLLM_DEFAULT_UTILIZATION == 0.92 and plan.vllm_facts["budget"] == int(0.92 * 80 * GiB)
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed: its source cannot be compared")
    source = (Path(next(iter(spec.submodule_search_locations))) / "config" / "cache.py").read_text()
    found = re.search(r"gpu_memory_utilization: float = Field\(\s*default=([0-9.]+)", source)
    assert found is not None and float(found.group(1)) == VLLM_DEFAULT_UTILIZATION


def test_cuda_graph_counts_follow_vllms_capture_rules():
    from trainer.orchestration.vllm_memory import VLLMSettings, capture_sizes, count_cuda_graphs

    # A published vLLM start-up log (max_num_seqs 256, 2048 batched tokens, no LoRA) reads "Profiling CUDA graph
    # memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)".
    sizes = capture_sizes(256, 2048)
    assert (len(sizes), sizes[-1]) == (51, 512)
    v = VLLMSettings("bfloat16", 32, 5, 2048, None, None, None, None, None)
    assert count_cuda_graphs(v, 256, 2048, lora=False) == (51, 35)
    assert count_cuda_graphs(v, 256, 2048, lora=True) == (51, 35)  # the gateway's: LoRA active, one set
    specialized = VLLMSettings("bfloat16", 32, 5, 2048, None, None, None, None, None, specialize_lora=True)
    assert count_cuda_graphs(specialized, 256, 2048, lora=True) == (102, 70)  # without and with LoRA active
    assert capture_sizes(4, 8192) == [1, 2, 4, 8]  # ceiling 2 x max_num_seqs; max_num_seqs itself included
    assert capture_sizes(1024, 100)[-1] == 100  # max_num_batched_tokens under the ceiling is captured
    eager = VLLMSettings("bfloat16", 32, 5, 2048, None, None, None, None, None, enforce_eager=True)
    assert count_cuda_graphs(eager, 256, 2048, lora=True) == (0, 0)


def test_the_kv_cache_is_the_budget_less_weights_slots_activations_and_cuda_graphs():
    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml")
    gateway = gateway_for(cfg)
    plan = build_memory_plan(cfg, LLAMA_8B, gateway, 80 * GiB, on_cuda=True)
    assert plan.vllm is not None
    parts = {p.name: p.bytes for p in plan.vllm.parts}
    graphs = parts["CUDA graphs (vLLM's estimate)"]
    assert (
        0.5 * GiB < graphs < 2 * GiB and plan.vllm_facts["graphs"] == 102
    )  # 51 sizes x 2 modes, LoRA active
    inside = sum(b for name, b in parts.items() if name not in ("KV cache", "CUDA context, NCCL (allowance)"))
    assert parts["KV cache"] == int(0.35 * 80 * GiB) - inside
    # vLLM's CUDA context sits outside its budget but not outside the GPU: the share the trainer must leave.
    assert plan.vllm_facts["share"] == plan.vllm.total == plan.vllm_facts["budget"] + GiB

    eager_gateway = {**gateway, "vllm": {**gateway["vllm"], "enforce_eager": True}}
    eager = build_memory_plan(cfg, LLAMA_8B, eager_gateway, 80 * GiB, on_cuda=True)
    assert eager.vllm_facts["kv"] - plan.vllm_facts["kv"] == graphs
    on_cpu = build_memory_plan(cfg, LLAMA_8B, gateway, 80 * GiB, on_cuda=False)
    assert on_cpu.vllm_facts["graphs"] == 0  # vLLM's CPU platform captures none


def test_the_plan_says_how_much_of_a_step_the_kv_cache_holds():
    from trainer.orchestration.memory_plan import format_plan

    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml")
    plan = build_memory_plan(cfg, LLAMA_8B, gateway_for(cfg), 80 * GiB, on_cuda=True)
    f = plan.vllm_facts
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert f["kv_tokens"] == f["kv"] // (per_token * 16) * 16
    line = [x for x in format_plan(plan, "launch.gpu_memory_gib") if "vLLM KV cache per replica" in x]
    assert line == [
        f"  vLLM KV cache per replica: {f['kv_tokens']} tokens = {f['kv_tokens'] / 2048:.1f} sequences of "
        "max_model_len 2048; a step samples 128 sequences (8 groups x 16) of up to 1024 tokens "
        f"(rollout.max_token_length, prompt + completion): {f['kv_tokens'] // 1024} fit at once = "
        f"{f['kv_tokens'] // 1024 / 128:.2f} step batches"
    ]
    # gsm8k's 0.35 of 80 GiB: about 8.6 GiB of KV cache, about half of one step's worst-case sequences at once.
    assert 70_000 < f["kv_tokens"] < 72_000 and f["sequences_at_once"] == 69


def trainer_argv(tmp_path: Path, overrides: list[str]) -> list[str]:
    from trainer.orchestration.commands import build_components

    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml", overrides)
    (trainer,) = [c for c in build_components(cfg, tmp_path, "/m") if c.name == "trainer"]
    return trainer.argv


def env_seen_by(argv: list[str], name: str) -> str | None:
    """The value of `name` in the environment the trainer's command line gives its Python (run for real, with the
    trainer's own prefix and a one-line program in place of `-m trainer ...`)."""
    import subprocess
    import sys

    prefix = argv[: argv.index(sys.executable)] if sys.executable in argv else []
    script = f"import os; print(os.environ.get({name!r}, '<unset>'))"
    out = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, check=True)
    value = out.stdout.strip()
    return None if value == "<unset>" else value


def test_the_trainer_starts_with_expandable_segments_unless_the_user_chose(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    argv = trainer_argv(tmp_path, ["model.device=cuda", "distributed.devices='1'"])
    assert env_seen_by(argv, "PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    assert env_seen_by(argv, "CUDA_VISIBLE_DEVICES") == "1"

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    argv = trainer_argv(tmp_path, ["model.device=cuda"])
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" not in argv
    assert env_seen_by(argv, "PYTORCH_CUDA_ALLOC_CONF") == "backend:cudaMallocAsync"

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # torch's newer name counts too
    assert env_seen_by(trainer_argv(tmp_path, ["model.device=cuda"]), "PYTORCH_CUDA_ALLOC_CONF") is None

    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert env_seen_by(trainer_argv(tmp_path, ["model.device=cpu"]), "PYTORCH_CUDA_ALLOC_CONF") is None


def test_a_dry_run_writes_nothing(tmp_path, monkeypatch, capsys):
    """`launch.sh ENV --dry-run` prints the run folder it would use and leaves no folder behind (in the runs folder,
    or in the directory it was started from)."""
    from trainer.orchestration import launcher

    runs, cwd = tmp_path / "runs", tmp_path / "cwd"
    runs.mkdir()
    cwd.mkdir()
    monkeypatch.setattr(launcher, "RUNS", runs)
    monkeypatch.chdir(cwd)
    assert launcher.main(["toy", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--dry-run"]) == 0
    assert f"output_dir: {runs}/toy-" in capsys.readouterr().out
    # `launch.sh service --dry-run` likewise: no service folder, no logs folder.
    from trainer.orchestration import service_launch

    tiny = str(ROOT / "configs" / "tiny_cpu.yaml")
    assert service_launch.main(["--config", tiny, "--dry-run", f"service.output_dir={runs / 'service'}"]) == 0
    assert list(runs.iterdir()) == [] and list(cwd.iterdir()) == []


def test_checkpointing_auto_recomputes_the_fewest_layers_that_fit_and_the_trainer_does_exactly_that(tmp_path):
    """gsm8k's auto: the plan recomputes no layer when the GPU has room, every layer when it is tight, a part in
    between; the count goes into the config the trainer reads, and the trainer checkpoints that many layers."""
    from trainer.backends.checkpointing import apply_gradient_checkpointing, spread_layers
    from trainer.orchestration.memory_plan import choose_recomputed_layers

    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml")
    assert cfg.model.gradient_checkpointing == "auto"
    gateway = gateway_for(cfg)
    counts = {}
    for gpu in (80, 141, 400):
        plan = build_memory_plan(cfg, LLAMA_8B, gateway, gpu * GiB, on_cuda=True)
        count, why = choose_recomputed_layers(plan, cfg)
        counts[gpu] = count
        assert "gradient checkpointing auto" in why and "the least that fits" in why, why
        # The choice fits, and one layer fewer would not (unless none is needed).
        chosen = cfg.model_copy(deep=True)
        chosen.model.checkpoint_layers = count
        assert (
            check_fit(build_memory_plan(chosen, LLAMA_8B, gateway, gpu * GiB, on_cuda=True), chosen, gateway)
            == []
        )
        if count:
            chosen.model.checkpoint_layers = count - 1
            fewer = build_memory_plan(chosen, LLAMA_8B, gateway, gpu * GiB, on_cuda=True)
            assert fewer.trainer.total > 0.9 * (gpu * GiB - fewer.shared_replicas * fewer.vllm_facts["share"])
    assert counts[400] == 0 and 0 < counts[141] <= counts[80] <= 32, counts
    assert counts[80] > counts[400]
    # Unplanned: every layer on a GPU, none on a CPU; true and false keep their meaning.
    assert cfg.model.recomputed_layers(32, on_cuda=True) == 32
    assert cfg.model.recomputed_layers(32, on_cuda=False) == 0
    # The trainer checkpoints the chosen layers, spread evenly.
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2
        )
    )
    cfg.model.checkpoint_layers = 3
    assert apply_gradient_checkpointing(model, cfg.model, on_cuda=True) == 3
    on = [j for j, layer in enumerate(model.model.layers) if layer.gradient_checkpointing]
    assert on == spread_layers(8, 3) and len(on) == 3


def test_the_dry_run_prints_the_checkpointing_choice_and_the_config_carries_it(tmp_path, capsys):
    from trainer.orchestration.launcher import main

    folder = write_model_folder(tmp_path)
    args = ["gsm8k", "--dry-run", f"model.path={folder}", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main([*args, "launch.gpu_memory_gib=141"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "gradient checkpointing auto:" in x)
    assert "the least that fits" in line and "no checkpointing would need" in line, line


def build_moe_backend(cfg: RunConfig, shape: dict[str, Any]) -> tuple[LocalBackend, dict[str, Any]]:
    """A random Qwen3-MoE (transformers' fused experts) of `shape` with E experts, top-k, expert width Ie."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=shape["V"],
        hidden_size=shape["h"],
        intermediate_size=shape["I"],
        moe_intermediate_size=shape["Ie"],
        num_experts=shape["E"],
        num_experts_per_tok=shape["k"],
        num_hidden_layers=shape["L"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["h"] // shape["heads"],
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    )
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, cfg.model.dtype))
    return LocalBackend(cfg, model=model), config.to_dict()


MOE = {**BASE, "h": 128, "I": 512, "Ie": 192, "E": 16, "k": 2, "L": 2, "heads": 4, "kv": 2, "B": 2, "T": 128}


def test_moe_weights_adapter_and_adam_parts_are_exact(tmp_path):
    """The experts counted: the base's parameters, PEFT's LoRA on the fused experts (gate_up at rank 2r, down,
    the router) and its Adam state, as a Qwen3-MoE built by transformers holds them."""
    cfg = small_cfg(tmp_path, MOE)
    backend, config = build_moe_backend(cfg, MOE)
    adam = AdamParams(
        learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0
    )
    backend.train_step(full_packed_batch(MOE, 0), cfg.loss.params(), "sum", adam)
    shape = ModelShape.from_config(config)
    assert shape.experts is not None and shape.experts.layers == MOE["L"] and shape.dense_layers == 0
    plan, _ = build_trainer_plan(shape, cfg, on_cuda=False)
    parts = {p.name: p.bytes for p in plan.parts}
    base = sum(p.numel() * p.element_size() for p in backend.model.parameters() if not p.requires_grad)
    lora = sum(p.numel() * p.element_size() for p in backend.model.parameters() if p.requires_grad)
    adam_state = sum(
        t.numel() * t.element_size()
        for s in backend.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    assert parts["base weights (float32)"] == base
    assert parts["LoRA parameters (float32)"] == lora
    assert parts["Adam moments (2 x float32)"] == adam_state


@pytest.mark.parametrize("gc", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_moe_activation_peak_matches_cpu_measurement(tmp_path, gc):
    """What PEFT's LoRA on fused experts keeps for backward (every expert's W + delta W, per layer) is in the plan."""
    cfg = small_cfg(tmp_path, MOE, gc=gc)
    backend, config = build_moe_backend(cfg, MOE)
    examples = full_packed_batch(MOE, 0)
    loss = cfg.loss.params()
    backend.forward_backward(examples, loss)
    backend.optimizer.zero_grad(set_to_none=True)
    measured = cpu_peak_bytes(lambda: backend.forward_backward(examples, loss))
    shape = ModelShape.from_config(config)
    act = compute_activation_bytes(shape, cfg, 4, cfg.model.recomputed_layers(shape.layers, on_cuda=False))
    predicted = max(act["layers"], act["logprobs"]) + 4 * lora_parameter_count(shape, cfg)[0]
    error = predicted / measured - 1
    print(
        f"moe gc={gc}: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB ({error:+.1%})"
    )
    assert abs(error) < 0.15, f"measured {measured}, predicted {predicted} ({error:+.1%})"


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json, the keys the plan reads
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def test_qwen3_30b_a3b_is_counted_with_its_experts():
    """30,532,122,624 parameters (the model card's 30.5B); the experts' LoRA buffers in every vLLM slot."""
    shape = ModelShape.from_config(QWEN3_30B_A3B)
    assert shape.parameter_count() == 30_532_122_624
    assert shape.mlp_width == 8 * 768
    dense = ModelShape.from_config({**QWEN3_30B_A3B, "num_experts": 0})
    assert dense.parameter_count() < 4e9  # what the plan counted before it knew experts


def test_the_qwen3_30b_a3b_recipe_dry_run_plans_the_experts_on_two_gpus(tmp_path, capsys):
    from trainer.orchestration.launcher import main

    folder = tmp_path / "qwen3-30b-a3b-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    recipe = str(ROOT / "configs" / "gsm8k_qwen3_30b_a3b.yaml")
    args = [
        "gsm8k",
        "--config",
        recipe,
        "--dry-run",
        f"model.path={folder}",
        f"trainer.output_dir={tmp_path / 'r'}",
    ]
    assert main([*args, "launch.gpu_memory_gib=80"]) == 0
    out = capsys.readouterr().out
    assert "128 experts of 768 (8 per token) in 48 layers" in out and "30.53B parameters" in out
    assert "experts: 128 per layer in 48 layers" in out  # vLLM's expert LoRA buffers in each slot
    # On one GPU the two could not share: the recipe's placement is what fits.
    shared = [
        "distributed.devices='0'",
        "inference.vllm.replica_devices=['0']",
        "inference.vllm.gpu_memory_utilization=0.3",
    ]
    assert main([*args, "launch.gpu_memory_gib=80", *shared]) == 2


def test_a_vllm_sharing_the_trainers_gpu_gets_the_plans_kv_cache_on_every_start(tmp_path):
    """gsm8k on an 80 GiB GPU it shares with the trainer (CUDA faked by the stated size): the launch writes the plan's
    KV cache into gateway.yaml, and vLLM's command, built afresh at every (re)start from that file, carries it, so a
    restart beside a trainer holding any amount of memory sizes the same cache. A user's value and a vLLM on a GPU
    of its own are left alone."""
    from inference.config import GatewayConfig
    from inference.samplers.vllm_command import build_vllm_command
    from trainer.orchestration.launcher import check_memory, gateway_section

    folder = write_model_folder(tmp_path)
    base = ["model.device=cuda", "launch.gpu_memory_gib=80", f"trainer.output_dir={tmp_path / 'run'}"]
    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml", base)
    check_memory(cfg, str(folder))
    gateway = gateway_section(cfg, str(folder))
    plan = build_memory_plan(
        load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml", base),
        LLAMA_8B,
        gateway_for(cfg),
        80 * GiB,
        on_cuda=True,
    )
    pinned = gateway["vllm"]["kv_cache_memory_bytes"]
    assert pinned == plan.vllm_facts["kv"] and 8 * GiB < pinned < 9 * GiB
    gateway_cfg = GatewayConfig.model_validate(gateway)
    for _start in range(2):  # the first start and a healing restart
        argv, _env = build_vllm_command(gateway_cfg, str(folder), 8000, "key", serve_cli=True)
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(pinned)
    # The pinned plan still fits: its budget is the same as the utilization's.
    assert build_memory_plan(cfg, LLAMA_8B, gateway, 80 * GiB, on_cuda=True).vllm_facts["kv"] == pinned

    mine = load_config(
        RunConfig, ROOT / "configs" / "gsm8k.yaml", [*base, "inference.vllm.kv_cache_memory_bytes=5000000000"]
    )
    check_memory(mine, str(folder))
    assert mine.inference["vllm"]["kv_cache_memory_bytes"] == 5_000_000_000
    own_gpu = ["distributed.devices='0'", "inference.vllm.replica_devices=['1']"]
    apart = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml", [*base, *own_gpu])
    check_memory(apart, str(folder))
    assert apart.inference["vllm"].get("kv_cache_memory_bytes") is None
