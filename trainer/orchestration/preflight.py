"""Checks launch.sh runs before starting anything: is the model here (or downloadable), is the Tinker key there,
does the config fit its GPU (trainer/orchestration/memory_plan.py). Each failure says what is missing and how to
supply it, within seconds. (The environment checks its own data:
the launcher runs `python -m environments.NAME preflight`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from trainer.training.config import ConfigError, RunConfig

HUB_URL = os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout_s: float = 5.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        httpx.head(HUB_URL, timeout=timeout_s, follow_redirects=True)
        return True
    except httpx.HTTPError:
        return False


def check_model(path: str, tokenizer_only: bool = False) -> str:
    """A local folder for the model (building the tiny one if asked), or the hub id when it can be downloaded.
    With `tokenizer_only` (the Tinker backend, whose weights stay remote) a folder holding a tokenizer is enough."""
    what = "tokenizer" if tokenizer_only else "model"
    if path == "tiny":
        from trainer.backends.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    if Path(path).is_dir():
        needed = "tokenizer_config.json" if tokenizer_only else "config.json"
        if not (Path(path) / needed).is_file():
            raise ConfigError(f"{what} {path!r} is a folder without {needed}: point it at a HF model folder")
        return str(Path(path).resolve())
    patterns = ["tokenizer*", "*.json"] if tokenizer_only else ["*.json", "*.safetensors", "tokenizer*"]
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, local_files_only=True, allow_patterns=patterns))
    except Exception:  # not in the local cache (the hub library raises several error types for this)
        pass
    if hub_reachable():
        return path
    if tokenizer_only:  # Tinker holds the weights: only the tokenizer is read here
        where, fix = f"the tokenizer of {path!r} (tinker.tokenizer, default model.path)", "tinker.tokenizer"
    else:
        where, fix = f"model.path={path!r}", "model.path"
    raise ConfigError(
        f"{where} is not a local folder, is not in the Hugging Face cache, and the hub is unreachable. Download it "
        f"where there is network (huggingface-cli download {path}) and copy the cache, or set {fix}=/path/to/folder"
    )


def check_tinker() -> list[str]:
    """The SDK installed and a key of the right shape, as problems to report (empty when fine)."""
    from trainer.backends.tinker import check_api_key, import_tinker

    problems = []
    for check in (import_tinker, check_api_key):
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def probe_gpu_memory() -> tuple[int, int] | None:
    """(total, free) bytes of the smallest visible CUDA device, or None without one. Read in a short-lived
    subprocess: a CUDA context in the launcher would hold ~0.5 GiB of the GPU for the whole run."""
    if not Path("/dev/nvidiactl").exists():
        return None
    code = (
        "import json, torch\n"
        "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "print(json.dumps([torch.cuda.mem_get_info(i) for i in range(n)]))"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        devices = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else []
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    if not devices:
        return None
    free, total = min(devices, key=lambda d: d[1])
    return int(total), int(free)


def fetch_model_config(repo_id: str) -> dict[str, Any] | None:
    """config.json alone from the hub (a few KB), for a plan before the weights are downloaded; None if refused
    (a gated or unknown repo, no network)."""
    try:
        from huggingface_hub import hf_hub_download

        return dict(json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text()))
    except Exception:  # the hub library raises many types (gated, missing, offline); the plan is then skipped
        return None


def plan_memory(
    cfg: RunConfig, model_path: str, gateway: dict[str, Any] | None, dry_run: bool
) -> tuple[list[str], list[str]]:
    """The memory plan's lines to print and the reasons the config cannot fit (empty when it fits, runs on CPU,
    or the GPU's size is unknown). A dry run without a GPU plans for CUDA unless model.device is cpu."""
    from trainer.orchestration.memory_plan import (
        GiB,
        build_memory_plan,
        check_fit,
        format_plan,
        load_model_config,
    )

    if cfg.launch.backend != "local":
        return [], []
    model_config = load_model_config(model_path)
    if model_config is None and hub_reachable():
        model_config = fetch_model_config(model_path)
    if model_config is None:
        return [
            f"memory plan: no config.json for model.path={model_path!r} here (not a folder, not in the Hugging Face "
            "cache); download the model (or point model.path at its folder) to see the plan"
        ], []
    probed = probe_gpu_memory() if cfg.model.device != "cpu" else None
    on_cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and (probed is not None or dry_run))
    stated = cfg.launch.gpu_memory_gib
    gpu_bytes = int(stated * GiB) if stated is not None else (probed[0] if probed else None)
    source = "launch.gpu_memory_gib" if stated is not None else "read from the device"
    plan = build_memory_plan(cfg, model_config, gateway, gpu_bytes, on_cuda)
    lines = format_plan(plan, source)
    problems = check_fit(plan, cfg, gateway)
    if probed is not None and not problems:
        need = plan.trainer.total + plan.shared_replicas * plan.vllm_facts.get("budget", 0)
        if need > probed[1]:
            lines.append(
                f"  warning: only {probed[1] / GiB:.2f} GiB of the GPU is free now (other processes hold the rest); "
                f"this run needs {need / GiB:.2f} GiB"
            )
    return lines, problems
