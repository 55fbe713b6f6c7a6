"""launch.wandb: who each process of a run is on W&B (trainer.training.wandb_group), what the launcher gives the
trainer and each environment process, and how the mode is chosen. The group itself, written offline by the real
processes and read back with W&B's reader, is tests/integration/test_wandb_group.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.orchestration.commands import ROOT, build_components
from trainer.training.config import ConfigError, RunConfig, load_config
from trainer.training.wandb_group import (
    describe,
    eval_numbers,
    has_credentials,
    wandb_group,
    wandb_mode,
    wandb_run_id,
)

RESIDUE = str(ROOT / "tests" / "envs" / "residue_tokens.py")


def never() -> bool:
    raise AssertionError("the login is not looked up when WANDB_MODE is set")


def test_the_users_wandb_mode_wins_else_online_with_a_login_and_offline_without():
    assert wandb_mode({"WANDB_MODE": "disabled"}, never) == "disabled"
    assert wandb_mode({"WANDB_MODE": "offline"}, never) == "offline"
    assert wandb_mode({}, lambda: True) == "online"
    assert wandb_mode({"WANDB_MODE": " "}, lambda: False) == "offline"


def test_a_login_is_a_key_in_the_environment_or_a_netrc_entry_for_wandbs_server(tmp_path, monkeypatch):
    # W&B's settings files: none of this machine's
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))
    base = {"WANDB_BASE_URL": "http://wandb.internal.test:8080"}  # the server whose .netrc entry counts
    netrc = tmp_path / "netrc"
    netrc.write_text("machine other.test login user password elsewhere\n")
    netrc.chmod(0o600)
    assert not has_credentials({**base, "NETRC": str(netrc)})
    assert not has_credentials({**base, "NETRC": str(tmp_path / "missing")})
    assert has_credentials({**base, "NETRC": str(tmp_path / "missing"), "WANDB_API_KEY": "k" * 40})
    netrc.write_text(netrc.read_text() + "machine wandb.internal.test login user password secret\n")
    assert has_credentials({**base, "NETRC": str(netrc)})


def test_run_ids_are_stable_per_process_and_folder_and_fit_wandbs_alphabet(tmp_path):
    run = tmp_path / "toy-20261126-003401 (copy)"
    ids = {wandb_run_id(run, p) for p in ("trainer", "env", "env-residue-1")}
    assert len(ids) == 3
    assert wandb_run_id(run, "env") == wandb_run_id(Path(str(run)), "env")
    elsewhere = tmp_path / "other" / run.name  # the same folder name elsewhere: another W&B run
    assert wandb_run_id(elsewhere, "env") != wandb_run_id(run, "env")
    for run_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id), run_id
    assert wandb_group(run) == run.name


def components(tmp_path: Path, *overrides: str) -> dict:
    cfg = load_config(
        RunConfig,
        None,
        [*overrides, "launch.run_api_url=http://api", "launch.gateway_url=http://gw"],
    )
    return {c.name: c for c in build_components(cfg, tmp_path, "/m")}


def test_with_launch_wandb_the_trainer_and_each_environment_join_the_runs_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    mix = f"rollout.envs=[{{env: toy}}, {{env: {RESIDUE}, name: residue, workers: 2}}]"
    comps = components(tmp_path, mix, "launch.wandb=true", "launch.wandb_project=proj")
    assert not comps["run-api"].env and not comps["gateway"].env
    procs = ["trainer", "env-toy", "env-residue-0", "env-residue-1"]
    for name in procs:
        env = comps[name].env
        assert env["WANDB_MODE"] == "offline" and env["WANDB_DIR"] == str(tmp_path)
        assert env["WANDB_RUN_GROUP"] == tmp_path.name and env["WANDB_PROJECT"] == "proj"
        assert env["WANDB_JOB_TYPE"] == ("trainer" if name == "trainer" else "environment")
        assert env["WANDB_RUN_ID"] == wandb_run_id(tmp_path, name) and env["WANDB_RESUME"] == "allow"
        if name != "trainer":
            assert "--env.use_wandb=True" in comps[name].argv
    assert len({comps[n].env["WANDB_RUN_ID"] for n in procs}) == len(procs)


def test_without_launch_wandb_no_process_logs_to_wandb(tmp_path):
    comps = components(tmp_path, "rollout.env=toy")
    assert "--env.use_wandb=False" in comps["env"].argv
    assert not any(c.env for c in comps.values())


def test_an_environment_may_not_turn_wandb_on_behind_launch_wandb(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.env_args\.use_wandb=True: the launcher sets it"):
        components(tmp_path, "rollout.env=toy", "rollout.env_args={use_wandb: true}")
    with pytest.raises(ConfigError, match=r"rollout\.envs\.1\.env_args\.use_wandb"):
        components(tmp_path, "rollout.envs=[{env: toy}, {env: gsm8k, env_args: {use_wandb: false}}]")


def test_the_launcher_says_where_the_group_goes(tmp_path):
    offline = describe(tmp_path, "proj", "offline")
    assert f"group {tmp_path.name} in project proj, offline" in offline
    assert f"wandb sync {tmp_path / 'wandb'}/offline-run-*" in offline
    assert describe(tmp_path, "proj", "online").endswith("WANDB_MODE=online")


def test_an_environment_logs_without_atroposlibs_registration_prefix_and_keeps_it_otherwise():
    import asyncio
    from types import SimpleNamespace

    from environments.common import unprefixed_wandb_log

    seen: list[object] = []

    async def original(self, metrics=None):
        seen.append(self.wandb_prepend)
        if metrics == "fail":
            raise RuntimeError("W&B refused")
        return metrics

    env = SimpleNamespace(wandb_prepend="toy-0_1")  # run-api's name for this registration: the second one
    wandb_log = unprefixed_wandb_log(original)
    assert asyncio.run(wandb_log(env, {"train/x": 1})) == {"train/x": 1}
    with pytest.raises(RuntimeError, match="W&B refused"):
        asyncio.run(wandb_log(env, "fail"))
    assert seen == [None, None]
    assert env.wandb_prepend == "toy-0_1"  # its env checkpoints' folder is still named by it


def test_wandb_gets_the_numbers_of_ok_evaluations_with_the_step_they_evaluated():
    row = {
        "step": 5,
        "status": "ok",
        "target": "step 5",
        "eval/pass@1": 0.5,
        "reported/acc": 1,
        "eval/x": True,
    }
    assert eval_numbers(row) == {"eval/pass@1": 0.5, "reported/acc": 1.0, "eval/step": 5.0}
    assert eval_numbers({**row, "status": "failed"}) == {}
    assert eval_numbers({"status": "ok", "step": None, "eval/pass@1": 0}) == {
        "eval/pass@1": 0.0,
        "eval/step": 0.0,
    }


def test_the_launcher_logs_each_ok_evaluation_once_and_a_failing_wandb_ends_only_that(
    tmp_path, monkeypatch, capsys
):
    from tests.helpers import make_cfg
    from trainer.orchestration import evaluation

    calls: list[object] = []

    class Recorder:
        def __init__(self, run_dir: Path, project: str, config: dict) -> None:
            calls.append(("open", run_dir, project, config["envs"]))

        def log(self, row: dict) -> None:
            calls.append(row["step"])

        def close(self) -> None:
            calls.append("close")

    monkeypatch.setattr(evaluation, "EvalRun", Recorder)
    ev = evaluation.Evaluator(make_cfg(tmp_path, launch__wandb=True), tmp_path, "http://gw", {})
    for row in ({"status": "ok", "step": 0}, {"status": "failed", "step": 5}, {"status": "ok", "step": 10}):
        ev._log_to_wandb(row)
    ev.stop()  # the end of the run: the W&B run is finished
    assert calls == [("open", tmp_path, "rl-lora", ["toy"]), 0, 10, "close"]

    class Unreachable(Recorder):
        def __init__(self, *args: object) -> None:
            calls.append("tried")
            raise RuntimeError("W&B is not reachable")

    monkeypatch.setattr(evaluation, "EvalRun", Unreachable)
    calls.clear()
    ev = evaluation.Evaluator(make_cfg(tmp_path, launch__wandb=True), tmp_path, "http://gw", {})
    ev._log_to_wandb({"status": "ok", "step": 0})
    ev._log_to_wandb({"status": "ok", "step": 5})
    assert calls == ["tried"]
    assert (
        "eval: not logged to W&B from now on: RuntimeError: W&B is not reachable" in capsys.readouterr().out
    )
    off = evaluation.Evaluator(make_cfg(tmp_path), tmp_path, "http://gw", {})  # launch.wandb=false
    off._log_to_wandb({"status": "ok", "step": 0})
    assert calls == ["tried"]
