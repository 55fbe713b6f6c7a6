"""Trainer throughput benchmark: LoRA forward+backward+AdamW tokens/s, MFU, peak memory, adapter save time.

    python -m benchmarks trainer                                   # tiny offline model on CPU
    python -m benchmarks trainer --shape llama-3.1-8b --device cuda  # random Llama-3.1-8B shape, seq 512, rank 32
    python -m benchmarks trainer --ragged                            # gsm8k-shaped steps: padded vs packed layouts

Prints one JSON object (medians over --steps timed steps after one warm-up) with the command, git sha and
hardware. The 8B shape is randomly initialised on the device: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.backends.local import LocalBackend
from trainer.orchestration.commands import git_sha
from trainer.training.batch import TrainingExample
from trainer.training.config import RunConfig
from trainer.training.loss_params import LossParams
from trainer.training.schedule import adam_params

COMMAND = "python -m benchmarks trainer"  # the command line the JSON records

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
}
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense tensor-core peaks (spec sheets)


def synthetic_examples(n: int, seq_len: int, vocab: int, prompt_len: int, seed: int) -> list[TrainingExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens = torch.randint(0, vocab, (seq_len + 1,), generator=g).tolist()
        trained = seq_len - prompt_len
        out.append(
            TrainingExample(
                input_ids=tokens[:-1],
                target_ids=tokens[1:],
                loss_mask=[0.0] * prompt_len + [1.0] * trained,
                sampler_logprobs=[0.0] * prompt_len + [-11.0] * trained,
                advantages=[0.0] * prompt_len + [1.0 if i % 2 else -1.0] * trained,
                group_index=i // 8,
                sequence_index=i % 8,
            )
        )
    return out


def provenance(args: argparse.Namespace, base_params: int) -> dict[str, Any]:
    """What every result records first: the command, revision, machine and settings that produced it."""
    return {
        "command": " ".join([COMMAND, *args.argv]),
        "git_sha": git_sha(),
        "hardware": hardware(),
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "argv"},
        "base_params": base_params,
    }


def ragged_examples(groups: int, group_size: int, vocab: int, seed: int) -> list[TrainingExample]:
    """gsm8k-shaped steps: groups sharing a 100-300 token prompt (not trained), completions of 32-256 tokens."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for gi in range(groups):
        prompt = torch.randint(0, vocab, (draw(100, 300),), generator=g).tolist()
        for si in range(group_size):
            tokens = prompt + torch.randint(0, vocab, (draw(32, 256),), generator=g).tolist()
            n, trained = len(tokens) - 1, len(tokens) - len(prompt)
            mask = [0.0] * (n - trained) + [1.0] * trained
            out.append(
                TrainingExample(
                    input_ids=tokens[:-1],
                    target_ids=tokens[1:],
                    loss_mask=mask,
                    sampler_logprobs=[-11.0 * m for m in mask],
                    advantages=[(1.0 if si % 2 else -1.0) * m for m in mask],
                    group_index=gi,
                    sequence_index=si,
                )
            )
    return out


LAYOUTS = {  # name -> (trainer.micro_batch_layout, trainer.shared_prefix_min_tokens)
    "padded": ("padded", 0),
    "packed": ("packed", 0),
    "packed_shared_prefix": ("packed", 16),
}


def run_ragged(args: argparse.Namespace) -> dict[str, Any]:
    """The layouts on the same gsm8k-shaped steps, one model, their steps interleaved (so the machine's noise
    falls on all alike): real tokens/s, computed/real tokens, peak memory and MFU (CUDA) of each, and ratios."""
    import tempfile

    args.seq_len = 556  # the longest prompt + completion
    backend, base_params = build_backend(args, Path(tempfile.mkdtemp(prefix="trainer-bench-")))
    device = backend.device
    examples = ragged_examples(args.groups, args.group_size, backend.vocab_size, 0)
    real = sum(len(e) for e in examples)
    adam = adam_params(1e-5, grad_clip_norm=1.0)
    loss = LossParams("importance_sampling")
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    computed: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for step in range(args.steps + 1):
        for name, (layout, min_prefix) in LAYOUTS.items():
            backend.cfg.trainer.micro_batch_layout = layout  # type: ignore[assignment]
            backend.cfg.trainer.shared_prefix_min_tokens = min_prefix
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            t0 = time.perf_counter()
            fb = backend.forward_backward(examples, loss)
            backend.optim_step(adam)
            sync(device)
            if step > 0:  # step 0 warms up kernels and allocators
                times[name].append(time.perf_counter() - t0)
            computed[name] = fb.metrics["tokens/forward_computed"]
            if device.type == "cuda":
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
    peak_flops = None
    if device.type == "cuda":
        peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in torch.cuda.get_device_name(0)), None)
    layouts: dict[str, dict[str, Any]] = {}
    for name in LAYOUTS:
        step_s = statistics.median(times[name])
        row: dict[str, Any] = {
            "step_s_median": step_s,
            "real_tokens_per_s": real / step_s,
            "computed_tokens": computed[name],
            "computed_over_real": computed[name] / real,
        }
        if name in peaks:
            row["peak_memory_gb"] = peaks[name]
        if peak_flops:
            # Hardware utilisation counts the tokens computed; the effective figure counts the real ones (what a
            # trainer without padding and without prefix sharing must compute).
            row["mfu"] = 4 * base_params * computed[name] / step_s / peak_flops
            row["effective_mfu"] = 4 * base_params * real / step_s / peak_flops
        layouts[name] = row
    base = layouts["padded"]["real_tokens_per_s"]
    return {
        **provenance(args, base_params),
        "sequences": len(examples),
        "real_tokens_per_step": real,
        "layouts": layouts,
        "speedup_vs_padded": {name: layouts[name]["real_tokens_per_s"] / base for name in LAYOUTS},
    }


def build_backend(args: argparse.Namespace, out_dir: Path) -> tuple[LocalBackend, int]:
    cfg = RunConfig.model_validate(
        {
            "model": {
                "path": "tiny",
                "device": args.device,
                "dtype": "auto",
                "gradient_checkpointing": args.gradient_checkpointing,
            },
            "lora": {"rank": args.rank, "alpha": args.rank, "target_modules": "all-linear"},
            "trainer": {
                "output_dir": str(out_dir),
                "max_seq_len": args.seq_len + 1,
                "micro_batch_tokens": max(args.micro_batch_tokens, args.seq_len + 1),
                "logprob_chunk_tokens": args.chunk_tokens,
            },
        }
    )
    model = None
    if args.shape != "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        device = torch.device(
            args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape], dtype=dtype))
            model = model.bfloat16() if dtype == torch.bfloat16 else model.float()
    backend = LocalBackend(cfg, model=model)
    base_params = sum(p.numel() for n, p in backend.model.named_parameters() if "lora_" not in n)
    return backend, base_params


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def time_steps(
    backend: LocalBackend, examples: list[TrainingExample], steps: int
) -> tuple[list[float], list[float]]:
    """Seconds per optimizer step and per forward_backward, `steps` times after one warm-up step."""
    adam = adam_params(1e-5, grad_clip_norm=1.0)
    loss = LossParams("importance_sampling")
    step_times, fb_times = [], []
    for step in range(steps + 1):
        sync(backend.device)
        t0 = time.perf_counter()
        backend.forward_backward(examples, loss)
        sync(backend.device)
        t1 = time.perf_counter()
        backend.optim_step(adam)
        sync(backend.device)
        if step > 0:  # step 0 warms up kernels and allocators
            step_times.append(time.perf_counter() - t0)
            fb_times.append(t1 - t0)
    return step_times, fb_times


def time_saves(backend: LocalBackend, saves: int) -> tuple[list[float], str]:
    """Seconds per adapter save for the sampler; the last adapter's folder."""
    save_times, path = [], ""
    for version in range(1, saves + 1):
        sync(backend.device)
        t0 = time.perf_counter()
        path = backend.save_for_sampler(version)
        save_times.append(time.perf_counter() - t0)
    return save_times, path


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    out_dir = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    backend, base_params = build_backend(args, out_dir)
    device = backend.device
    examples = synthetic_examples(args.batch_seqs, args.seq_len, backend.vocab_size, args.prompt_len, 0)
    tokens_per_step = args.batch_seqs * args.seq_len
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_times, fb_times = time_steps(backend, examples, args.steps)
    save_times, path = time_saves(backend, args.saves)
    adapter_bytes = (Path(path) / "adapter_model.safetensors").stat().st_size
    step_s = statistics.median(step_times)
    result: dict[str, Any] = {
        **provenance(args, base_params),
        "lora_params": sum(p.numel() for p in backend.params),
        "tokens_per_step": tokens_per_step,
        "step_s_median": step_s,
        "forward_backward_s_median": statistics.median(fb_times),
        "train_tokens_per_s": tokens_per_step / step_s,
        "adapter_mb": adapter_bytes / 1e6,
        "adapter_save_s_median": statistics.median(save_times),
        "adapter_save_s_max": max(save_times),
    }
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in torch.cuda.get_device_name(0)), None)
        # 4 x params x tokens: forward 2 + backward activation-gradients 2 (LoRA: no weight gradients for the base)
        result["achieved_tflops"] = 4 * base_params * tokens_per_step / step_s / 1e12
        if peak:
            result["peak_bf16_tflops"] = peak / 1e12
            result["mfu"] = result["achieved_tflops"] * 1e12 / peak
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128, help="untrained prefix tokens per sequence")
    p.add_argument("--batch-seqs", type=int, default=16)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    p.add_argument("--saves", type=int, default=5, help="timed adapter saves")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--ragged",
        action="store_true",
        help="gsm8k-shaped steps (groups sharing a 100-300 token prompt, completions 32-256): the padded layout "
        "against packing and packing with the shared prompt computed once, one JSON line",
    )
    p.add_argument("--groups", type=int, default=8, help="--ragged: groups per step")
    p.add_argument("--group-size", type=int, default=16, help="--ragged: sequences per group")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the JSON's command
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.ragged:
        print(json.dumps(run_ragged(args)))
    else:
        print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
