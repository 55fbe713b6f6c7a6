"""A tinker path never reaches outside the service's folder (trainer/service/app.py, Service.state_folder)."""

from __future__ import annotations

from unittest.mock import MagicMock

import pytest

from trainer.service.routes import build_app
from trainer.service.wire import UserError
from trainer.training.config import RunConfig


@pytest.mark.parametrize(
    "path",
    [
        "tinker://../weights/X",
        "tinker://./weights/X",
        "tinker://.hidden/weights/X",
        "tinker:///weights/X",
        "tinker://a/weights/..",
        "tinker://a/weights/.x",
    ],
)
def test_paths_that_would_leave_the_run_are_refused(tmp_path, path):
    out = tmp_path / "service"
    (tmp_path / "weights" / "X").mkdir(parents=True)  # what the escape reached: the folder above the output
    (tmp_path / "weights" / "X" / "state.json").write_text("{}")
    (tmp_path / "sampler_weights" / "X").mkdir(parents=True)
    (tmp_path / "sampler_weights" / "X" / "adapter_config.json").write_text("{}")
    cfg = RunConfig.model_validate({"service": {"output_dir": str(out)}})
    service = build_app(cfg, MagicMock()).state.service
    with pytest.raises(UserError):
        service.resolve(path)
    with pytest.raises(UserError):
        service.resolve_sampler_path(path.replace("/weights/", "/sampler_weights/"))
