"""Helpers for tests/gpu/test_gpu.py: gsm8k-shaped synthetic batches, figures printed as one JSON line, and one rank of
the NCCL equality run, which torchrun starts with this file as its script:

    python -m torch.distributed.run --standalone --nproc_per_node N tests/gpu/gpu_helpers.py OUT_DIR MICRO_BATCH_TOKENS
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
# Run as torchrun's script, this file's folder is on sys.path, not the repository.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainer.training.batch import TrainingExample  # noqa: E402

# What one step of configs/gsm8k.yaml trains: 8 groups of 16 sequences; a chat-templated grade-school question
# of ~100-300 tokens shared by its group, then up to rollout.max_new_tokens=256 sampled tokens.
GSM8K_GROUPS, GSM8K_GROUP_SIZE = 8, 16
GSM8K_PROMPT_TOKENS = (100, 300)
GSM8K_COMPLETION_TOKENS = (32, 256)
# What a random-init 8B model gives any token: about -ln(vocab), so importance ratios stay near 1.
RANDOM_MODEL_LOGPROB = -11.0


def report(check: str, **figures: Any) -> None:
    """One JSON line of figures, for a person running `bash tests/run.sh -m gpu -s`."""
    where = {"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {}
    print(json.dumps({"gpu_check": check, **where, **figures}), flush=True)


def release_cuda_memory() -> None:
    """Give the caching allocator's free blocks back to the driver, so the next test (or a vLLM that checks free
    memory before it starts) finds them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gsm8k_examples(vocab_size: int, seed: int) -> list[TrainingExample]:
    """One step of gsm8k-shaped examples: group-shared prompts, sampled-length completions, group-centred
    advantages, random token ids below vocab_size."""
    g = torch.Generator().manual_seed(seed)

    def between(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=g).item())

    out = []
    for group in range(GSM8K_GROUPS):
        prompt = torch.randint(0, vocab_size, (between(GSM8K_PROMPT_TOKENS),), generator=g).tolist()
        scores = torch.randint(0, 2, (GSM8K_GROUP_SIZE,), generator=g).float()
        advantages = (scores - scores.mean()).tolist()
        for seq in range(GSM8K_GROUP_SIZE):
            completion = torch.randint(
                0, vocab_size, (between(GSM8K_COMPLETION_TOKENS),), generator=g
            ).tolist()
            tokens = prompt + completion
            trained = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
            out.append(
                TrainingExample(
                    input_ids=tokens[:-1],
                    target_ids=tokens[1:],
                    loss_mask=trained,
                    sampler_logprobs=[RANDOM_MODEL_LOGPROB * m for m in trained],
                    advantages=[advantages[seq] * m for m in trained],
                    group_index=group,
                    sequence_index=seq,
                )
            )
    return out


def echo_logprobs(url: str, tokens: list[int]) -> tuple[list[float], int]:
    """The served policy's logprob of each token after the first (prompt echo), and the version that served it."""
    import httpx

    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"model": "any", "prompt": tokens, "max_tokens": 1, "echo": True, "logprobs": 0},
    )
    r.raise_for_status()
    logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(tokens)]
    return [float(x) for x in logprobs], int(r.headers["x-policy-version"])


# --- the NCCL equality run: tests/dist_step.py's three steps, on CUDA over NCCL ------------------------------------


def run_ranks(out: Path, nproc: int, micro_batch_tokens: int) -> dict[str, Any]:
    """Start `nproc` ranks of this file under torchrun; rank 0's results (per step) and its LoRA weights' path."""
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    argv += [str(Path(__file__).resolve()), str(out), str(micro_batch_tokens)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads((out / "results.json").read_text()))


def exact_fp32_matmuls() -> None:
    """Undo the TF32 that LocalBackend turns on for cuBLAS on CUDA (the same switch it sets): TF32's 10-bit
    rounding depends on how a batch is cut into shards and micro-batches, so 1 and 2 ranks would differ by far
    more than the fp32 tolerance compared."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False


def rank_main(out: Path, micro_batch_tokens: int) -> None:
    """One rank: tests/dist_step.py's three steps with model.device=cuda, float32 and distributed.backend=nccl;
    rank 0 writes the results and the LoRA weights."""
    import torch.distributed as dist

    from tests.dist_step import three_steps

    run = three_steps(
        out, micro_batch_tokens, {"device": "cuda", "dtype": "float32"}, "nccl", exact_fp32_matmuls
    )
    if run is None:
        return
    run.save_lora(out / "lora.safetensors")
    steps = [
        {
            "loss": step["loss"],
            "grad_norm": step["grad_norm"],
            "tokens_trained": step["metrics"]["tokens/trained"],
            "ratio_mean": step["metrics"]["importance/ratio_mean"],
            "trainer_logprobs": step["trainer_logprobs"],
        }
        for step in run.steps
    ]
    results = {
        "world_size": run.info.world_size,
        "device": str(run.local.device),
        "process_group_backend": dist.get_backend() if dist.is_initialized() else None,
        "steps": steps,
    }
    (out / "results.json").write_text(json.dumps(results))
    run.close()


def compare_runs(
    one: dict[str, Any], two: dict[str, Any], w1: dict[str, Any], w2: dict[str, Any]
) -> dict[str, float]:
    """The largest differences between a 1-rank and a 2-rank run, in the units tests/integration/test_distributed.py bounds."""

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(a), 1e-12)

    pairs = list(zip(one["steps"], two["steps"], strict=True))
    return {
        "loss_rel": max(rel(a["loss"], b["loss"]) for a, b in pairs),
        "grad_norm_rel": max(rel(a["grad_norm"], b["grad_norm"]) for a, b in pairs),
        "ratio_mean_rel": max(rel(a["ratio_mean"], b["ratio_mean"]) for a, b in pairs),
        "tokens_trained_equal": float(all(a["tokens_trained"] == b["tokens_trained"] for a, b in pairs)),
        "logprob_abs": max(
            abs(p - q)
            for a, b in pairs
            for x, y in zip(a["trainer_logprobs"], b["trainer_logprobs"], strict=True)
            for p, q in zip(x, y, strict=True)
        ),
        "lora_rel_frobenius": max(float((w1[k] - w2[k]).norm() / w1[k].norm()) for k in w1),
        "lora_abs": max(float((w1[k] - w2[k]).abs().max()) for k in w1),
        "lora_b_moved": max(float(t.abs().max()) for k, t in w1.items() if "lora_B" in k),
    }


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), int(sys.argv[2]))
