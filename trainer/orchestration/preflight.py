"""Checks launch.sh runs before starting anything: is the model here (or downloadable), is the Tinker key there.
Each failure says what is missing and how to supply it, within seconds. (The environment checks its own data:
the launcher runs `python -m environments.NAME preflight`.)"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from trainer.training.config import ConfigError

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
