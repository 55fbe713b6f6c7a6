"""A run folder on a disk that fills up: one clear error (the folder, the bytes free, the checkpoint a resume
loads), the last good checkpoint still loadable, and no restart loop (the trainer exits with the code the
launcher does not restart). A real tmpfs of a few MiB; skipped where this user cannot mount one."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.backends.local import LocalBackend
from trainer.training.checkpoints import LoopState, full_disk_is_one_error, read_latest
from trainer.training.config import RunConfig, load_config
from trainer.training.faults import DiskFull
from trainer.training.recovery import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_bytes: int) -> None:
    """Take all but `leave_bytes` of the disk."""
    import shutil

    free = shutil.disk_usage(disk).free
    with (disk / "filler").open("wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(0, free - leave_bytes))


def test_a_full_disk_is_one_clear_error_and_the_last_checkpoint_loads(small_disk, tiny_model_path):
    run_dir = small_disk / "run"
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "tiny_cpu.yaml",
        [f"trainer.output_dir={run_dir}", f"model.path={tiny_model_path}"],
    )
    backend = LocalBackend(cfg)
    save_checkpoint(backend, run_dir, LoopState(5, 5))
    saved = {k: v.clone() for k, v in backend.model.state_dict().items() if "lora" in k}
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if "lora" in name:
                param.add_(1.0)  # what a later step would have changed
    fill(small_disk, leave_bytes=4096)
    with pytest.raises(DiskFull) as caught, full_disk_is_one_error(run_dir):
        save_checkpoint(backend, run_dir, LoopState(10, 10))
    message = str(caught.value)
    assert str(run_dir) in message and "bytes free" in message and "step-000005" in message
    assert "--resume" in message
    found = read_latest(run_dir)
    assert found is not None and found[1] == LoopState(5, 5), "`latest` must not move"
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name], "temp write left behind"
    (small_disk / "filler").unlink()
    fresh = LocalBackend(cfg)
    fresh.load_state(str(found[0]))
    for key, value in fresh.model.state_dict().items():
        if key in saved:
            assert torch.equal(value, saved[key]), key


def test_the_trainer_exits_with_the_code_the_launcher_does_not_restart():
    from trainer.orchestration.processes import Component
    from trainer.orchestration.supervisor import LaunchError, Supervisor
    from trainer.training.faults import EXIT_NEEDS_OPERATOR

    cfg = load_config(RunConfig, None, ["launch.max_restarts_per_hour=2"])
    comps = [
        Component(n, ["true"], Path(f"/nonexistent/{n}.log"))
        for n in ("run-api", "gateway", "env", "trainer")
    ]
    sup = Supervisor(comps, cfg, Path("/nonexistent"))
    with pytest.raises(LaunchError, match="needs you"):
        sup.allow_restart(sup.trainer, EXIT_NEEDS_OPERATOR)
    sup.allow_restart(sup.envs[0], -9)
    sup.allow_restart(sup.envs[0], -9)
    with pytest.raises(LaunchError, match=r"restarted 2 times within the hour.*max_restarts_per_hour=2"):
        sup.allow_restart(sup.envs[0], -9)
    sup.allow_restart(sup.trainer, 1)  # each component has its own budget
    off = Supervisor(comps, load_config(RunConfig, None, ["launch.max_restarts_per_hour=0"]), Path("/x"))
    with pytest.raises(LaunchError, match="restarts are off"):
        off.allow_restart(off.api, -9)
