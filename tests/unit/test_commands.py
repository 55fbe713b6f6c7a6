"""The command names: benchmarks run as `python -m benchmarks NAME`, the trainer's former benchmark commands
point there, and the run-folder readers stay `python -m trainer summary|report`. In-process: no subprocess."""

from __future__ import annotations

import importlib

import pytest

import benchmarks.__main__ as bench_cli
import trainer.__main__ as trainer_cli


@pytest.mark.parametrize("old", sorted(trainer_cli.MOVED))
def test_a_former_trainer_benchmark_command_names_its_new_one(old: str, capsys: pytest.CaptureFixture[str]):
    assert trainer_cli.main([old, "--minutes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and trainer_cli.MOVED[old] in err


def test_every_benchmark_is_a_module_with_main_and_is_listed(capsys: pytest.CaptureFixture[str]):
    for module, _ in bench_cli.COMMANDS.values():
        assert callable(importlib.import_module(module).main)
    with pytest.raises(SystemExit) as done:
        bench_cli.main(["--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in bench_cli.COMMANDS)
    with pytest.raises(SystemExit) as done:
        bench_cli.main([])  # no name: argparse's error, which lists the names
    assert done.value.code == 2


def test_a_benchmark_takes_the_rest_of_the_line(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as done:
        bench_cli.main(["gateway", "--help"])
    assert done.value.code == 0 and "python -m benchmarks gateway" in capsys.readouterr().out


def test_the_run_folder_readers_keep_their_commands(tmp_path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "metrics.jsonl").write_text('{"call": "optim_step", "seconds": 0.5, "unix_time": 1.0}\n')
    assert trainer_cli.main(["summary", str(tmp_path)]) == 0
    assert '"optim_steps": 1' in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        trainer_cli.main(["report", "--help"])
    assert done.value.code == 0 and "python -m trainer report" in capsys.readouterr().out


def test_the_entry_point_builds_the_backend_and_releases_the_other_ranks(tmp_path, monkeypatch):
    """`python -m trainer run`: rank 0 builds the backend, runs the loop on it and then lets the other ranks go;
    ranks > 0 only follow. The loop itself never builds a backend (tests/unit/test_import_graph.py)."""
    from trainer.backends import build
    from trainer.training import loop
    from trainer.training.config import RunConfig, load_config

    calls: list[str] = []
    cfg = load_config(
        RunConfig,
        None,
        [f"trainer.output_dir={tmp_path}", "launch.run_api_url=http://h:1", "launch.gateway_url=http://h:2"],
    )
    backend = object()
    monkeypatch.setattr(build, "build_backend", lambda c: calls.append("build") or backend)
    monkeypatch.setattr(build, "follow_rank_zero", lambda c: calls.append("follow"))
    monkeypatch.setattr(build, "release", lambda b: calls.append(f"release:{b is backend}"))
    monkeypatch.setattr(loop, "run", lambda c, b: calls.append(f"loop:{b is backend}") or False)
    monkeypatch.setenv("RANK", "0")
    assert trainer_cli.train(cfg) is False and calls == ["build", "loop:True", "release:True"]
    calls.clear()
    monkeypatch.setenv("RANK", "1")
    assert trainer_cli.train(cfg) is True and calls == ["follow"]
    with pytest.raises(ValueError, match=r"launch\.run_api_url"):
        trainer_cli.train(
            cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"gateway_url": None})})
        )
