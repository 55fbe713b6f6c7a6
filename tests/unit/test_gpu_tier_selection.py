"""tests/run.sh runs the GPU tier where torch sees CUDA (tests/gpu/available.py), and says why not elsewhere."""

from __future__ import annotations

from tests.gpu import available


def test_the_gpu_tier_runs_only_where_cuda_is_seen(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert available.main() == 0 and available.why_not() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert available.main() == 1
    assert "GPU tier skipped: torch sees no CUDA GPU" in capsys.readouterr().err
