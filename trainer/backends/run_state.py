"""What a training state on disk needs beside the weights: the random generators' state (captured so that
torch.load(weights_only=True) reads it back, and restored), the run's seeding, and a folder written whole or not at
all."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.training.checkpoints import fsync_path


class atomic_dir:
    """Write into a hidden temp folder beside dest, fsync it, then rename: readers (and a resume after a power cut)
    see all of it or none of it."""

    def __init__(self, dest: Path):
        self.dest = dest
        self.tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"

    def __enter__(self) -> Path:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for path in self.tmp.iterdir():
            fsync_path(path)
        fsync_path(self.tmp)
        os.rename(self.tmp, self.dest)
        fsync_path(self.dest.parent)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    # Only tensors, ints, floats, strings and tuples: what torch.load(weights_only=True) reads back.
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # the legacy form is always (str, ndarray, int, int, float)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
