"""What identifies a model folder across processes and paths: a shared engine (`launch.sh engine`) refuses a run
whose model or tokenizer is not the one it serves. Read from small files only (config.json, the tokenizer's files,
the weight files' names and sizes): the weights themselves can be hundreds of GB."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class ModelIdentity(BaseModel):
    name: str  # for people: the folder, as the process that read it knows it
    model: str  # config.json and the weight files' names and sizes
    tokenizer: str  # the tokenizer's files

    def mismatch(self, other: ModelIdentity) -> str | None:
        """What differs from `other` ("model", "tokenizer"), None when both are the same."""
        if self.model != other.model:
            return "model"
        if self.tokenizer != other.tokenizer:
            return "tokenizer"
        return None


def _digest(parts: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in parts:
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:32]


def model_identity(folder: str | Path) -> ModelIdentity:
    """The identity of a local model folder (what launch.sh resolves model.path to)."""
    root = Path(folder)
    config = root / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{root}: no config.json, not a model folder")
    weights = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    model = [("config.json", config.read_bytes())] + [
        (p.name, str(p.stat().st_size).encode()) for p in weights
    ]
    tokenizer = [(n, (root / n).read_bytes()) for n in TOKENIZER_FILES if (root / n).is_file()]
    return ModelIdentity(name=str(root), model=_digest(model), tokenizer=_digest(tokenizer))
