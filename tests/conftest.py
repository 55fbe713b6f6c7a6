from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The offline random Llama, built once per machine and cached."""
    from trainer.backends.tiny_model import ensure_tiny_model

    return ensure_tiny_model()
