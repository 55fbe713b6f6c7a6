"""What every export source is made of: the adapter folder's files, the base model as a local folder (with its hub
id and revision when it came from the Hugging Face cache), and the refusal every step raises. Nothing here writes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HUB_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]{7,64})")


class ExportError(Exception):
    """An export that cannot be done as asked; the message says why and what to do."""


@dataclass(frozen=True)
class BaseModel:
    folder: Path  # a local Hugging Face model folder
    hub_id: str | None  # org/name when the folder is a snapshot in the Hugging Face cache
    revision: str | None  # that snapshot's commit

    @property
    def name(self) -> str:
        return self.hub_id or str(self.folder)


@dataclass(frozen=True)
class ExportSource:
    adapter: Path  # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
    base: BaseModel
    config: dict[str, Any]  # the run's resolved config as written (not validated: an older run still exports)
    run_dir: Path | None
    version: int | None  # the policy version (None for a checkpoint's adapter)
    step: int | None  # the optimizer step that produced it, when known
    label: str  # how the card and messages name it: "version 12 (step 12)", "checkpoint step-000040"


def base_model(config: dict[str, Any]) -> BaseModel:
    """The run's base model as a local folder, or ExportError naming the command that fetches it."""
    from trainer.orchestration.preflight import cached_model, fetch_command

    path = str((config.get("model") or {}).get("path") or "")
    from trainer.backends.tiny_model import tiny_model_named

    tiny = tiny_model_named(path)  # an offline test model, rebuilt identically from its seed where not cached
    if tiny is not None:
        return BaseModel(tiny, None, None)
    folder = Path(path)
    if folder.is_dir() and (folder / "config.json").is_file():
        return hub_origin(folder.resolve())
    if path and not path.startswith(("/", ".", "~")):
        cached = cached_model(path, tokenizer_only=False)
        if cached is not None:
            return hub_origin(Path(cached))
        raise ExportError(
            f"the base model {path!r} is not available offline; fetch it with `{fetch_command(path, False)}` and "
            "export again"
        )
    raise ExportError(
        f"the run's base model folder {path!r} is gone (model.path in the run's config); put the model back there "
        "or edit model.path in the run's config.yaml to where it is now"
    )


def hub_origin(folder: Path) -> BaseModel:
    """The hub id and revision of a Hugging Face cache snapshot folder; neither for any other folder."""
    found = HUB_SNAPSHOT.search(folder.as_posix())
    if found is None:
        return BaseModel(folder, None, None)
    return BaseModel(folder, f"{found['org']}/{found['name']}", found["rev"])
