"""Checks launch.sh runs before starting anything: is the model here (or downloadable), does the environment
have its data. Each failure is a ConfigError that says what is missing and how to supply it, within seconds."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import httpx

from trainer.config import ConfigError, RunConfig

HUB_URL = os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout_s: float = 5.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        httpx.head(HUB_URL, timeout=timeout_s, follow_redirects=True)
        return True
    except httpx.HTTPError:
        return False


def check_model(path: str) -> str:
    """A local folder for the model (building the tiny one if asked), or the hub id when it can be downloaded."""
    if path == "tiny":
        from trainer.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    if Path(path).is_dir():
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"model.path={path!r} is a folder without config.json: point it at a HF model folder")
        return str(Path(path).resolve())
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, local_files_only=True, allow_patterns=["*.json", "*.safetensors",
                                                                                   "tokenizer*"]))
    except Exception:  # not in the local cache (the hub library raises several error types for this)
        pass
    if hub_reachable():
        return path
    raise ConfigError(
        f"model.path={path!r} is not a local folder, is not in the Hugging Face cache, and the hub is unreachable. "
        f"Download it where there is network (huggingface-cli download {path}) and copy the cache, or set "
        "model.path=/path/to/model_folder")


def check_environment(cfg: RunConfig) -> None:
    """Run the built-in environment's own `preflight(cfg)` when it has one (e.g. gsm8k's data check)."""
    if cfg.rollout.env.endswith(".py"):
        return
    module = importlib.import_module(f"environments.{cfg.rollout.env}")
    check = getattr(module, "preflight", None)
    if check is not None:
        check(cfg)
