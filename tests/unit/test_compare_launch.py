"""`launch.sh compare`'s command lines (trainer/orchestration/compare.py): every run gets the same recipe and
overrides, its own backend and folder; an override for one side goes to that side alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.orchestration.compare import parse_args, run_argv


def argv_after_module(argv: list[str]) -> list[str]:
    return argv[argv.index("trainer.orchestration.launcher") + 1 :]


def test_each_run_gets_the_shared_overrides_and_its_own_backend_and_folder(tmp_path: Path):
    args = parse_args(
        [
            "toy",
            "--config",
            "configs/tiny_cpu.yaml",
            "optim.lr=2e-2",
            "tinker:optim.lr=5e-3",
            "local:inference.engine_url=http://127.0.0.1:4000",
        ]
    )
    local = argv_after_module(run_argv(args, "local", tmp_path / "local"))
    tinker = argv_after_module(run_argv(args, "tinker", tmp_path / "tinker"))
    assert local == [
        "toy",
        "--config",
        "configs/tiny_cpu.yaml",
        "--backend",
        "local",
        "eval.every_steps=0",
        "optim.lr=2e-2",
        "inference.engine_url=http://127.0.0.1:4000",
        f"trainer.output_dir={tmp_path / 'local'}",
    ]
    assert tinker == [
        "toy",
        "--config",
        "configs/tiny_cpu.yaml",
        "--backend",
        "tinker",
        "eval.every_steps=0",
        "optim.lr=2e-2",
        "optim.lr=5e-3",
        f"trainer.output_dir={tmp_path / 'tinker'}",
    ]  # the later override wins in the launcher's dotted overrides


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["toy", "--backends", "local"], "at least two"),
        (["toy", "--backends", "local,local"], "each once"),
        (["toy", "--backends", "local,vllm"], "at least two"),
        (["toy", "trainer.output_dir=/x"], "sets each run's folder"),
        (["toy", "tinker:launch.backend=local"], "sets each run's folder and backend"),
        (["toy", "gpu:optim.lr=1"], "'gpu' is not one of the compared backends"),
    ],
)
def test_a_comparison_that_cannot_compare_is_refused(argv, says, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2 and says in capsys.readouterr().err
