"""CUDA-only checks (marker `gpu`, deselected by default; run with `bash tests/run.sh -m gpu` on a GPU box)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import FIXTURE
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.losses import LossParams
from trainer.training.schedule import adam_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_backend_trains_and_saves_bf16_adapter(tmp_path):
    from tests.test_local_backend import lora_state, make_cfg
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
