"""The GPU smoke tier: what only a CUDA box can show, each check printing its figures as one JSON line.

    bash tests/run.sh -m gpu -s tests/gpu/test_gpu.py

Marked `gpu` (deselected by default, never in CI) and skipped without CUDA. It checks:
  1. set-up: `python -m trainer.backends.cuda_check` finds CUDA usable (driver against the wheel's CUDA);
  2. a bf16 LocalBackend trains the tiny model and saves a bf16 adapter;
  3. the trainer on a random Llama-3.1-8B-shaped model with configs/gsm8k.yaml's trainer settings (bf16 base, LoRA
     rank 32 all-linear, gradient checkpointing, 16384-token micro-batches), 3 gsm8k-shaped steps: peak CUDA
     memory against the memory plan's trainer figure; then the same distilling from a second 8B-shaped teacher
     model, against the plan that counts the teacher;
  4. vLLM on CUDA in bf16 behind the gateway (needs vLLM): two verified publishes (runtime LoRA load and unload)
     with their verification figures, the previous version's adapter refused, and a kill -9 of vLLM healed with
     the current version still served;
  4a. expert LoRA of a mixture-of-experts model (tiny-moe, needs vLLM): adapters written one expert at a time load
     into vLLM on CUDA and pass verification; PEFT's fused layout is refused;
  4b. the closed loop (needs vLLM): `bash launch.sh toy` on CUDA in bf16 (trainer, adapter and vLLM on one GPU, the
     plan's KV cache pinned) learns the toy task with every publish verified at the first try;
  5. 2 NCCL ranks make the same update as 1 (needs 2 GPUs): tests/integration/test_distributed.py's gloo check on CUDA;
  6. `python -m benchmarks trainer --shape llama-3.1-8b --device cuda` prints its JSON with tokens/s.
A box with torch, transformers and peft but no vLLM runs everything but 4, 4a and 4b.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.gpu.gpu_helpers import (
    compare_runs,
    echo_logprobs,
    gsm8k_examples,
    release_cuda_memory,
    report,
    run_ranks,
)
from tests.helpers import FIXTURE, assert_learned, launch_cmd, read_metrics, run_launch
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.config import RunConfig, load_config
from trainer.training.gateway_client import GatewayClient, verification_failure
from trainer.training.loss_params import LossParams
from trainer.training.polling import wait_until
from trainer.training.schedule import adam_params, build_adam_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def run_module(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )


def test_cuda_check_passes():
    proc = run_module(["trainer.backends.cuda_check"], 120)
    report("cuda_check", returncode=proc.returncode, message=proc.stderr.strip()[-500:])
    assert proc.returncode == 0, proc.stderr


def test_bf16_backend_trains_and_saves_bf16_adapter(tmp_path):
    from tests.helpers import lora_state, make_cfg
    from trainer.backends.local import LocalBackend

    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples
    backend = LocalBackend(make_cfg(tmp_path, model__device="cuda"))
    assert next(backend.model.get_base_model().parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in backend.params)
    before = lora_state(backend)
    fb = backend.forward_backward(examples, LossParams("importance_sampling"))
    assert fb.metrics["importance/logprob_diff_mean"] < 0.05  # bf16 base vs fp32 sampler
    backend.optim_step(adam_params(1e-2))
    assert any(not torch.equal(before[n], p) for n, p in lora_state(backend).items())
    saved = load_file(backend.save_for_sampler(1) + "/adapter_model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in saved.values())


def test_8b_trainer_peak_memory_is_within_the_plan(tmp_path):
    """3 steps of gsm8k-shaped batches on a random Llama-3.1-8B shape under configs/gsm8k.yaml: the measured peak
    must not exceed the plan (the plan would let an OOM through) nor fall below half of it (the plan would refuse
    configs that fit)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.trainer_bench import SHAPES
    from trainer.backends.local import LocalBackend
    from trainer.orchestration.memory_plan import build_memory_plan, check_fit, choose_recomputed_layers
    from trainer.orchestration.model_shape import GiB

    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml", [f"trainer.output_dir={tmp_path}"])
    release_cuda_memory()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES["llama-3.1-8b"]), dtype=torch.bfloat16)
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    plan = build_memory_plan(cfg, model.config.to_dict(), None, gpu_bytes, on_cuda=True)
    # The recipe's checkpointing auto, as the launcher resolves it on this GPU (the trainer alone on it).
    cfg.model.checkpoint_layers, why = choose_recomputed_layers(plan, cfg)
    plan = build_memory_plan(cfg, model.config.to_dict(), None, gpu_bytes, on_cuda=True)
    assert check_fit(plan, cfg, None) == []
    backend = LocalBackend(cfg, model=model)
    del model
    steps = []
    try:
        for step in range(3):
            examples = gsm8k_examples(backend.vocab_size, seed=step)
            torch.cuda.synchronize()
            started = time.perf_counter()
            fb, optim = backend.train_step(
                examples, cfg.loss.params(), cfg.loss.reduction, build_adam_params(step, cfg.optim)
            )
            torch.cuda.synchronize()
            tokens = sum(len(e) for e in examples)
            steps.append(
                {
                    "tokens": tokens,
                    "micro_batches": fb.metrics["perf/micro_batches"],
                    "seconds": round(time.perf_counter() - started, 2),
                    "grad_norm": optim["optim/grad_norm"],
                }
            )
            assert optim["optim/skipped_nonfinite"] == 0
        measured = torch.cuda.max_memory_allocated() - baseline
    finally:
        del backend
        release_cuda_memory()
    report(
        "trainer_8b_peak_memory",
        measured_peak_gib=round(measured / GiB, 2),
        plan_trainer_gib=round(plan.trainer.total / GiB, 2),
        ratio=round(measured / plan.trainer.total, 3),
        plan_parts_gib={p.name: round(p.bytes / GiB, 2) for p in plan.trainer.parts},
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        checkpointing=why,
        steps=steps,
    )
    assert 0.5 * plan.trainer.total <= measured <= plan.trainer.total


def test_8b_distillation_from_a_teacher_model_is_within_the_plan(tmp_path):
    """configs/gsm8k.yaml's trainer distilling from a second random Llama-3.1-8B shape (a teacher model of its own,
    placed as load_teacher places one; loading from a folder is covered on CPU): 2 gsm8k-shaped steps of teacher
    scoring + training. The measured peak must lie within the plan that counts the teacher's weights, and above half
    of it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.trainer_bench import SHAPES
    from trainer.backends.local import LocalBackend
    from trainer.orchestration.memory_plan import build_memory_plan
    from trainer.orchestration.model_shape import GiB
    from trainer.training.distill import distill_examples

    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml", [f"trainer.output_dir={tmp_path}"])
    release_cuda_memory()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    shape = LlamaConfig(**SHAPES["llama-3.1-8b"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        student = AutoModelForCausalLM.from_config(shape, dtype=torch.bfloat16)
        teacher = AutoModelForCausalLM.from_config(shape, dtype=torch.bfloat16)
    teacher.eval().requires_grad_(False)
    config = student.config.to_dict()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    plan = build_memory_plan(cfg, config, None, gpu_bytes, on_cuda=True, teacher_config=config)
    backend = LocalBackend(cfg, model=student)
    backend.teacher_model = teacher
    del student, teacher
    steps = []
    try:
        for step in range(2):
            examples = gsm8k_examples(backend.vocab_size, seed=step)
            torch.cuda.synchronize()
            started = time.perf_counter()
            scored = backend.teacher_logprobs(examples)
            torch.cuda.synchronize()
            teacher_s = time.perf_counter() - started
            distilled, metrics = distill_examples(examples, scored, kl_coef=1.0, reward_coef=0.0)
            backend.train_step(
                distilled, cfg.loss.params(), cfg.loss.reduction, build_adam_params(step, cfg.optim)
            )
            torch.cuda.synchronize()
            steps.append(
                {
                    "tokens": sum(len(e) for e in examples),
                    "teacher_s": round(teacher_s, 2),
                    "step_s": round(time.perf_counter() - started, 2),
                    "teacher_kl": round(metrics["distill/teacher_kl"], 3),
                }
            )
        measured = torch.cuda.max_memory_allocated() - baseline
    finally:
        del backend
        release_cuda_memory()
    report(
        "distill_8b_teacher_model",
        measured_peak_gib=round(measured / GiB, 2),
        plan_trainer_gib=round(plan.trainer.total / GiB, 2),
        ratio=round(measured / plan.trainer.total, 3),
        plan_parts_gib={p.name: round(p.bytes / GiB, 2) for p in plan.trainer.parts},
        steps=steps,
    )
    assert 0.5 * plan.trainer.total <= measured <= plan.trainer.total


def vllm_cuda_overrides(run_dir: Path) -> list[str]:
    """The tiny CPU recipe on CUDA: bf16 throughout (vLLM's CUDA LoRA kernels take only fp16/bf16), a small share
    of the GPU for vLLM (its start-up refuses unless that much is free), and max_staleness 0 so that each publish
    unloads the version before it."""
    return [
        "model.device=cuda",
        "model.dtype=bfloat16",
        "trainer.save_dtype=bfloat16",
        "inference.vllm.dtype=bfloat16",
        "inference.vllm.gpu_memory_utilization=0.2",
        "rollout.max_staleness=0",
        f"trainer.output_dir={run_dir}",
    ]


@dataclass
class PublishRig:
    cfg: RunConfig
    backend: Any
    url: str
    client: GatewayClient
    publisher: Any
    examples: list[Any]

    def train_two_updates(self) -> None:
        """Two updates: each version's logprobs clearly its own."""
        for _ in range(2):
            self.backend.forward_backward(self.examples, self.cfg.loss.params(), self.cfg.loss.reduction)
            self.backend.optim_step(adam_params(2e-2))


@contextlib.contextmanager
def cuda_publish_rig(tmp_path: Path, overrides: list[str]) -> Iterator[PublishRig]:
    """The tiny recipe's trainer (LocalBackend) and a gateway over vLLM on CUDA, with a publisher between them; the
    GPU's memory released afterwards."""
    from trainer.backends.local import LocalBackend
    from trainer.orchestration.gateway_process import spawn_gateway
    from trainer.training.publishing import Publisher

    config = ROOT / "configs" / "tiny_cpu.yaml"
    cfg = load_config(RunConfig, config, overrides)
    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples
    backend = LocalBackend(cfg)
    with spawn_gateway(str(config), overrides, tmp_path / "gateway", timeout_s=600) as (url, _):
        client = GatewayClient(url)
        publisher = Publisher(cfg, backend, client, overlap=False)
        rig = PublishRig(cfg, backend, url, client, publisher, examples)
        try:
            yield rig
        finally:
            publisher.close()
            client.close()
    # The caller's `rig` outlives this: drop its references to the model before releasing the GPU's memory.
    rig.backend = rig.publisher = None
    del backend, publisher
    release_cuda_memory()


def test_vllm_on_cuda_verifies_bf16_publishes_refuses_the_previous_adapter_and_heals(tmp_path):
    """The toy recipe's trainer and gateway on one GPU in bf16: versions 1 and 2 (two updates each) pass the
    calibrated verification at the first try, version 1's adapter under version 2's probe is refused, and vLLM
    killed with SIGKILL comes back serving version 2."""
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here: the gateway checks need the gpu extra's vLLM"
    )
    from trainer.training.publishing import Publisher

    with cuda_publish_rig(tmp_path, vllm_cuda_overrides(tmp_path / "run")) as rig:
        assert rig.publisher.statistic == "mean", "bf16 is judged on the calibrated mean difference"
        published = {}
        for version in (1, 2):
            rig.train_two_updates()
            outcome = rig.publisher.start(version).result()
            published[version] = outcome
            figures = Publisher.metrics(outcome)
            report(
                "bf16_publish_verified",
                version=version,
                unloaded=outcome.reply.unloaded,
                load_s=round(outcome.reply.load_s, 3),
                **{k.split("/")[1]: v for k, v in figures.items() if k.startswith("publish/verify")},
            )
            assert outcome.failures == 0, f"version {version} was refused {outcome.failures} time(s) first"
            assert outcome.reply.verify_mean_abs_diff is not None
        assert published[2].reply.unloaded == [1], "max_staleness 0: publishing 2 unloads 1"

        # The previous version's adapter (a sync that kept the old weights) under the current weights' probe.
        stale = shutil.copytree(tmp_path / "run" / "adapters" / "v000001", tmp_path / "stale-v1")
        probe, _ = rig.publisher.probe()
        with pytest.raises(httpx.HTTPStatusError) as refused:
            rig.client.publish(3, str(stale), probe=probe)
        failure = verification_failure(refused.value)
        report("bf16_previous_adapter_refused", status=refused.value.response.status_code, failure=failure)
        assert failure is not None, refused.value.response.text
        assert rig.client.status().current_version == 2

        heal_figures = kill_vllm_and_wait(rig.url, rig.client)
        report("vllm_kill_9_healed", **heal_figures)
        assert heal_figures["served_version_after"] == 2
        assert heal_figures["max_logprob_change"] < 0.05  # the same adapter, bf16 reruns


def test_expert_lora_of_a_moe_model_loads_into_cuda_vllm_and_passes_verification(tmp_path):
    """tiny-moe (a Qwen3-MoE, 4 experts) with LoRA on attention, every expert and the router, in bf16: the adapters
    written one expert at a time (trainer/backends/expert_lora.py) load into vLLM on CUDA and pass the calibrated
    verification at the first try, version after version; PEFT's own fused layout of the same weights is refused by
    the gateway's check before vLLM sees it."""
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here: the gateway checks need the gpu extra's vLLM"
    )
    from trainer.training.publishing import Publisher

    overrides = [
        *vllm_cuda_overrides(tmp_path / "run"),
        "model.path=tiny-moe",
        "lora.target_modules=all-linear",
        "inference.vllm.max_lora_rank=16",  # the experts' gate_up trains at 2 x lora.rank
    ]
    with cuda_publish_rig(tmp_path, overrides) as rig:
        for version in (1, 2):
            rig.train_two_updates()
            outcome = rig.publisher.start(version).result()
            figures = Publisher.metrics(outcome)
            report(
                "moe_expert_lora_publish_verified",
                version=version,
                load_s=round(outcome.reply.load_s, 3),
                **{k.split("/")[1]: v for k, v in figures.items() if k.startswith("publish/verify")},
            )
            assert outcome.failures == 0, f"version {version} was refused {outcome.failures} time(s) first"
        rig.backend.model.save_pretrained(str(tmp_path / "fused"))
        probe, _ = rig.publisher.probe()
        with pytest.raises(httpx.HTTPStatusError) as refused:
            rig.client.publish(3, str(tmp_path / "fused"), probe=probe)
        assert refused.value.response.status_code == 422, refused.value.response.text
        assert "not a linear module" in refused.value.response.text
        assert rig.client.status().current_version == 2


def test_the_toy_recipe_learns_on_cuda_in_bf16_through_vllm(tmp_path):
    """The whole loop as a CUDA user runs it: `bash launch.sh toy` with the trainer, the adapter and vLLM in bf16 on
    one GPU. It learns, every version passes the calibrated verification at the first try, vLLM got the plan's KV
    cache (a GPU it shares with the trainer), and the step time is reported."""
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here: the closed loop needs the gpu extra's vLLM"
    )
    run_dir = tmp_path / "run"
    overrides = [o for o in vllm_cuda_overrides(run_dir) if not o.startswith("trainer.output_dir=")]
    rc, out, elapsed = run_launch(launch_cmd(run_dir, *overrides), 1800)
    assert rc == 0, out[-4000:]
    rows = read_metrics(run_dir)
    assert_learned([r["reward/mean"] for r in rows])
    assert all(r["publish/verify_failures"] == 0 for r in rows if r["loss"] is not None), rows
    gateway = (run_dir / "gateway.yaml").read_text()
    assert "kv_cache_memory_bytes: null" not in gateway, (
        "a vLLM sharing the trainer's GPU gets the plan's cache"
    )
    times = sorted(r["time/step_s"] for r in rows if r.get("time/step_s") is not None)
    report(
        "toy_closed_loop_cuda_bf16",
        steps=len(rows),
        wall_s=round(elapsed, 1),
        median_step_s=times[len(times) // 2] if times else None,
        final_reward=rows[-1]["reward/mean"],
        verify_margin_min=min(
            (r["publish/verify_margin"] for r in rows if r.get("publish/verify_margin") is not None),
            default=None,
        ),
    )


def kill_vllm_and_wait(url: str, client: GatewayClient) -> dict[str, float]:
    """SIGKILL the gateway's vLLM (its PID from GET /policy); /health must turn 503 and then 200 again, with the
    same version served as before."""
    tokens = [5, 6, 7, 8, 100, 200, 300, 400]
    before, version = echo_logprobs(url, tokens)
    status = client.status()
    assert status.backend_pid is not None and status.current_version == version
    os.kill(status.backend_pid, signal.SIGKILL)
    killed = time.monotonic()

    def health(code: int) -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == code
        except httpx.HTTPError:
            return False

    wait_until(lambda: health(503), 30, "gateway /health 503 after vLLM's kill", 0.05)
    unhealthy_s = time.monotonic() - killed
    wait_until(lambda: health(200), 600, "gateway /health 200 after vLLM's restart", 0.5)
    ready_s = time.monotonic() - killed
    after, served = echo_logprobs(url, tokens)
    now = client.status()
    assert now.restarts == status.restarts + 1 and now.backend_pid != status.backend_pid
    assert now.current_version == version
    return {
        "unhealthy_after_s": round(unhealthy_s, 2),
        "ready_after_s": round(ready_s, 1),
        "served_version_after": served,
        "max_logprob_change": max(abs(a - b) for a, b in zip(before, after, strict=True)),
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 GPUs (found {torch.cuda.device_count()})")
@pytest.mark.parametrize("micro_batch_tokens", [64, 4096])
def test_two_nccl_ranks_make_the_same_update_as_one(tmp_path, micro_batch_tokens):
    """tests/integration/test_distributed.py's 1-vs-2-rank check (three AdamW steps on the fixture batch, fp32) on CUDA over
    NCCL, with its tolerances."""
    one = run_ranks(tmp_path / "one", 1, micro_batch_tokens)
    two = run_ranks(tmp_path / "two", 2, micro_batch_tokens)
    w1 = load_file(str(tmp_path / "one" / "lora.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "lora.safetensors"))
    figures = compare_runs(one, two, w1, w2)
    report(
        "nccl_two_ranks_equal_one",
        micro_batch_tokens=micro_batch_tokens,
        backend=two["process_group_backend"],
        devices=[one["device"], two["device"]],
        **figures,
    )
    assert two["world_size"] == 2 and two["process_group_backend"] == "nccl"
    assert one["device"].startswith("cuda") and two["device"].startswith("cuda")
    assert w1.keys() == w2.keys() and any("lora_A" in k for k in w1)
    assert figures["lora_b_moved"] > 1e-2, (
        "the steps must move the adapter for the comparison to mean anything"
    )
    assert figures["tokens_trained_equal"] == 1.0
    assert figures["loss_rel"] < 1e-5 and figures["grad_norm_rel"] < 1e-5 and figures["ratio_mean_rel"] < 1e-5
    assert figures["logprob_abs"] < 1e-5
    assert figures["lora_rel_frobenius"] < 1e-4 and figures["lora_abs"] < 1e-4


def test_the_8b_bench_prints_its_json():
    """The throughput benchmark as a person runs it. Gradient checkpointing on: without it the bench's default
    batch (16 x 512 tokens in one micro-batch) plans to ~95 GiB on the 8B shape."""
    release_cuda_memory()
    args = ["benchmarks", "trainer", "--shape", "llama-3.1-8b", "--device", "cuda"]
    proc = run_module([*args, "--gradient-checkpointing", "--steps", "3", "--saves", "2"], 900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = proc.stdout.find("{")
    assert start >= 0, f"no JSON in the bench's output: {proc.stdout[-2000:]}"
    result, _ = json.JSONDecoder().raw_decode(proc.stdout[start:])
    report("bench_8b", **{k: v for k, v in result.items() if k not in ("command", "config")})
    assert result["train_tokens_per_s"] > 0 and result["peak_memory_gb"] > 15


def test_the_8b_ragged_bench_prints_padded_and_packed_figures():
    """gsm8k-shaped steps on the 8B shape: the padded layout against packing and packing with each group's prompt
    computed once, in one run (the figures for benchmarks/RESULTS.md: MFU, computed/real tokens, peak memory)."""
    release_cuda_memory()
    args = ["benchmarks", "trainer", "--ragged", "--shape", "llama-3.1-8b", "--device", "cuda"]
    proc = run_module([*args, "--gradient-checkpointing", "--steps", "2"], 900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report("bench_8b_ragged", **{k: v for k, v in result.items() if k != "config"})
    layouts = result["layouts"]
    assert layouts["packed_shared_prefix"]["computed_over_real"] < 0.6
    assert result["speedup_vs_padded"]["packed_shared_prefix"] > 1.0
