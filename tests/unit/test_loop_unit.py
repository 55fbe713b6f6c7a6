"""Pure parts of the closed loop: staleness filtering, launcher command lines, environments' reward code."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from environments.gsm8k import extract_gold, score_completion
from environments.toy import compute_target_ids, compute_toy_reward
from trainer.orchestration.commands import build_components, env_command
from trainer.orchestration.supervisor import progress_line
from trainer.training.checkpoints import truncate_metrics
from trainer.training.config import ConfigError, RunConfig, load_config
from trainer.training.staleness import split_by_staleness

ROOT = Path(__file__).resolve().parents[2]


def test_split_by_staleness():
    groups = [{"tokens": [[1], [2]]}, {"tokens": [[3], [4]]}, {"tokens": [[5], [6]]}, {"tokens": [[7]]}]
    versions = [[5, 5], [3, 3], [2, 2], [None]]
    out = split_by_staleness(groups, versions, current=5, max_staleness=2)
    assert out.kept == groups[:2]
    assert out.staleness == [0, 0, 2, 2]
    assert (out.dropped_stale, out.dropped_unknown) == (2, 1)
    on_policy = split_by_staleness(groups, versions, current=5, max_staleness=0)
    assert on_policy.kept == groups[:1] and on_policy.dropped_stale == 4
    # Unknown (never seen by the gateway) is kept on request; abandoned by a rollback (-1) never is.
    mixed = [*versions, [-1], [4, None]]
    kept = split_by_staleness([*groups, {"tokens": [[8]]}, {"tokens": [[9], [10]]}], mixed, 5, 2, True)
    assert len(kept.kept) == 4 and kept.kept_unknown == 2 and kept.dropped_unknown == 1
    assert kept.staleness == [0, 0, 2, 2, 1]


def test_truncate_metrics_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
    assert truncate_metrics(path, 5) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_env_command_uses_key_equals_value_and_a_server_list():
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "tiny_cpu.yaml",
        ["launch.run_api_url=http://127.0.0.1:1", "launch.gateway_url=http://127.0.0.1:2"],
    )
    argv = env_command(cfg, "/m", worker=0)
    assert argv[1:4] == ["-m", "environments.toy", "serve"]
    flags = dict(a[2:].split("=", 1) for a in argv[4:])
    assert flags["env.total_steps"] == "-1"  # one token: `--flag -1` would be read as a boolean flag
    assert flags["env.group_size"] == "8" and flags["env.batch_size"] == "64"
    assert flags["env.max_batches_offpolicy"] == "1"  # max(1, max_staleness=1)
    assert flags["openai.base_url"] == "http://127.0.0.1:2/v1" and flags["openai.server_type"] == "vllm"
    assert flags["env.use_wandb"] == "False" and flags["env.wandb_name"] == "toy-0"


def test_any_env_file_runs_through_the_upstream_runner(tmp_path):
    env_file = tmp_path / "my_env.py"
    env_file.write_text("# an Atropos env\n")
    cfg = load_config(
        RunConfig,
        None,
        [f"rollout.env={env_file}", "launch.run_api_url=http://h:1", "launch.gateway_url=http://h:2"],
    )
    argv = env_command(cfg, "/m", 0)
    # The runner passes on only the flags the file's config class declares (environments/upstream).
    assert argv[1:5] == ["-m", "environments.upstream", str(env_file), "serve"]
    assert "--env.temperature=1.0" in argv
    with pytest.raises(
        ConfigError, match=r"unknown environment 'nope': built-in ones are \['gsm8k', 'toy'\]"
    ):
        env_command(load_config(RunConfig, None, ["rollout.env=nope"]), "/m", 0)


def test_components_in_start_order(tmp_path):
    cfg = load_config(RunConfig, ROOT / "configs" / "tiny_cpu.yaml", ["rollout.env_workers=2"])
    names = [c.name for c in build_components(cfg, tmp_path, "/m")]
    assert names == ["run-api", "gateway", "env-0", "env-1", "trainer"]


def test_progress_line_handles_steps_without_update():
    row = {
        "step": 3,
        "policy_version": 2,
        "reward/mean": 0.5,
        "loss": None,
        "time/step_s": 1.0,
        "time/wait_for_batch_s": 0.5,
        "time/train_s": 0.0,
        "time/publish_s": 0.0,
        "policy/staleness_mean": 1.0,
        "policy/staleness_max": 1.0,
        "rollouts/dropped_stale": 0.0,
    }
    line = progress_line(row, 10)
    assert "step    3/10" in line and "loss -" in line and "v2" in line
    # A stop cut the step's publish short: its row has no publish time (the resume publishes it again).
    assert "publish -s" in progress_line({**row, "time/publish_s": None}, 10)


def test_toy_reward():
    targets = frozenset({10, 11})
    assert compute_toy_reward([10, 11, 5, 10], targets, {2}, 4) == 0.75
    assert compute_toy_reward([10, 2, 11, 11], targets, {2}, 4) == 0.25  # nothing counts after EOS
    assert compute_toy_reward([2], targets, {2}, 4) == 0.0
    ids = compute_target_ids(100, {0, 1, 2}, 0.1, seed=3)
    assert len(ids) == 10 and not ids & {0, 1, 2} and ids == compute_target_ids(100, {0, 1, 2}, 0.1, seed=3)


def test_gsm8k_grading():
    assert extract_gold("Natalia sold 48 clips... #### 1,072") == "1072"
    with pytest.raises(ValueError):
        extract_gold("no marker")
    assert score_completion("so she sold \\boxed{1072} clips", "1072") == 1.0
    assert score_completion("The answer is 1072.", "1072") == 1.0
    assert score_completion("The answer is 1071.", "1072") == 0.0
    assert score_completion("\\boxed{", "1072") == 0.0


def test_summary_idle_share_and_rewards():
    from trainer.readout.summary import summarize

    rows = [
        {
            "step": i,
            "policy_version": i,
            "reward/mean": r,
            "loss": 0.1,
            "time/step_s": 2.0,
            "time/wait_for_batch_s": 0.5,
            "time/train_s": 1.4,
            "time/publish_s": 0.1,
            "policy/staleness_mean": 1.0,
            "rollouts/dropped_stale": 0.0,
            "importance/logprob_diff_mean": 1e-5,
            "wall_s": 2.0 * i,
        }
        for i, r in enumerate([0.1, 0.2, 0.3, 0.9, 1.0, 1.0], start=1)
    ]
    s = summarize(rows)
    assert s["idle_share"] == pytest.approx(0.25) and s["reward_first3"] == pytest.approx(0.2)
    assert s["reward_last3"] == pytest.approx(2.9 / 3) and s["publish_s_median"] == 0.1
    assert s["step_reaching_reward_0.8"] == 4 and s["wall_s_to_reward_0.8"] == 8.0
    # Publishes overlapped with the next batch's wait are off the trainer's path: the idle share counts only
    # what neither trains nor publishes inline.
    for r in rows:
        r.update({"time/publish_overlapped": 1.0, "time/step_s": 1.9, "publish/verify_s": 0.01})
    s = summarize(rows)
    assert s["idle_share"] == pytest.approx(0.5 / 1.9) and s["publish_share"] == 0.0
    assert s["verify_share_of_publish"] == pytest.approx(0.1) and s["publish_overlapped_share"] == 1.0
    assert s["teacher_kl_first3"] is None and s["teacher_tokens_scored_total"] is None  # no teacher
    for i, r in enumerate(rows):  # a distillation run: the teacher KL falls 6, 5, 4, ... 1
        r.update({"distill/teacher_kl": 6.0 - i, "distill/teacher_s": 0.2, "distill/tokens_scored": 10.0})
    s = summarize(rows)
    assert s["teacher_kl_first3"] == 5.0 and s["teacher_kl_last3"] == 2.0 and s["teacher_s_median"] == 0.2
    assert s["teacher_tokens_scored_total"] == 60.0


def test_metrics_writer_with_wandb_offline(tmp_path, monkeypatch):
    from trainer.training.metrics_file import MetricsWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(RunConfig, None, [f"trainer.output_dir={tmp_path}", "launch.wandb=true"])
    writer = MetricsWriter(tmp_path / "metrics.jsonl", use_wandb=True, cfg=cfg)
    writer.write({"step": 1, "reward/mean": 0.5, "loss": None})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 0.5
    assert list((tmp_path / "wandb").glob("offline-run-*")), "W&B offline run folder missing"


def test_resume_takes_overrides_after_the_run_folder(tmp_path, capsys):
    """`launch.sh --resume RUN_DIR rollout.num_steps=50`: argparse would hand the override to the env positional."""
    import yaml

    from trainer.orchestration.launcher import main

    cfg = load_config(
        RunConfig,
        Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml",
        [f"trainer.output_dir={tmp_path}"],
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["--resume", str(tmp_path), "rollout.num_steps=50", "optim.lr=0.5", "--dry-run"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out.split("# commands")[0])
    assert printed["rollout"]["num_steps"] == 50 and printed["optim"]["lr"] == 0.5


def test_environments_resume_their_data_position(tmp_path):
    """Saved at each checkpoint step; a (re)started env takes the newest at or before its registration step, and
    what a killed process's write left behind is swept."""
    from types import SimpleNamespace

    from environments.common import ResumableData
    from environments.toy import ToyEnv

    assert ToyEnv.data_position == ("next_index",)

    def env(step: int, index: int) -> SimpleNamespace:
        ns = SimpleNamespace(
            checkpoint_dir=str(tmp_path), config=SimpleNamespace(wandb_name="toy-0"), curr_step=step
        )
        ns.data_position, ns.next_index = ("next_index",), index
        ns._position_folder = lambda: ResumableData._position_folder(ns)  # type: ignore[arg-type]
        return ns

    ResumableData.save_checkpoint(env(0, 41), 10)  # type: ignore[arg-type]
    # An earlier process of this environment was killed while it wrote step 15: its half-written file is not a
    # position, and the next process's start and writes remove it.
    cut = tmp_path / "env_checkpoints" / "toy-0" / ".step-15.json.tmp-999999"
    cut.write_text('{"next_in')
    ResumableData.save_checkpoint(env(0, 90), 20)  # type: ignore[arg-type]
    assert not cut.exists()
    cut.write_text('{"next_in')
    restarted = env(17, 0)
    ResumableData.load_checkpoint(restarted)  # type: ignore[arg-type]
    assert restarted.next_index == 41 and not cut.exists()
    assert sorted(p.name for p in cut.parent.iterdir()) == ["step-10.json", "step-20.json"]
    fresh = env(5, 0)
    ResumableData.load_checkpoint(fresh)  # type: ignore[arg-type]
    assert fresh.next_index == 0


def resumable_run(tmp_path: Path, old_dir: str, step: int, num_steps: int) -> Path:
    import yaml

    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "tiny_cpu.yaml",
        [f"trainer.output_dir={old_dir}", f"rollout.num_steps={num_steps}"],
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    (tmp_path / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    (tmp_path / "checkpoints" / f"step-{step:06d}.loop.json").write_text(
        json.dumps({"step": step, "version": 9})
    )
    (tmp_path / "checkpoints" / "latest").write_text(f"step-{step:06d}")
    return tmp_path


def test_resume_uses_the_folder_wherever_it_now_lives(tmp_path):
    from argparse import Namespace

    from trainer.orchestration.launcher import resolve_run

    run = resumable_run(tmp_path, "/somewhere/it/used/to/be", 10, 30)
    cfg, run_dir = resolve_run(Namespace(resume=str(run), overrides=[]))
    assert run_dir == run.resolve() and cfg.trainer.output_dir == str(run.resolve())


def test_resuming_a_finished_run_starts_nothing_and_exits_0(tmp_path, capsys):
    from trainer.orchestration.launcher import main

    run = resumable_run(tmp_path, str(tmp_path), 30, 30)
    started = time.monotonic()
    assert main(["--resume", str(run)]) == 0
    assert time.monotonic() - started < 5  # no pre-flight, no process
    out = capsys.readouterr().out
    assert "already finished" in out and "step 30 of 30" in out
    assert not (run / "logs").exists() and not (run / "pids.json").exists()


def test_a_multi_turn_sequence_gets_its_oldest_turns_version():
    """An episode that spans a publish: its first turn's prompt+reply was recorded under version 4, its last under
    5. The sequence counts as version 4 (so the staleness window sees it); single-turn sequences, a turn the ledger
    does not know, and an unknown whole sequence keep their own answer."""
    from trainer.training.batch import IGNORE_INDEX, earlier_turn_ends
    from trainer.training.staleness import ABANDONED, versions_by_group

    P = IGNORE_INDEX
    multi = [1, 2, 3, 4, 5, 6, 7, 8]
    multi_mask = [P, P, 3, 4, P, P, 7, 8]  # prompt, reply, user turn, reply
    single, single_mask = [1, 2, 9, 9], [P, P, 9, 9]
    ledger = {tuple(multi): 5, tuple(multi[:4]): 4, tuple(single): 5, (7, 7, 7, 7): 3, (7, 7): ABANDONED}
    asked: list[list[list[int]]] = []

    class Ledger:
        def lookup(self, sequences: list[list[int]]) -> list[int | None]:
            asked.append(sequences)
            return [ledger.get(tuple(s)) for s in sequences]

    assert earlier_turn_ends(multi_mask) == [4] and earlier_turn_ends(single_mask) == []
    unknown_turn = [1, 2, 3, 4, 5, 6, 7, 9]  # whole sequence unknown: stays unknown
    groups = [
        {"tokens": [multi, single], "masks": [multi_mask, single_mask]},
        {"tokens": [unknown_turn, [7, 7, 7, 7]], "masks": [multi_mask, [P, 7, P, 7]]},
    ]
    assert versions_by_group(Ledger(), groups) == [[4, 5], [None, ABANDONED]]  # type: ignore[arg-type]
    assert len(asked) == 1 and len(asked[0]) == 4 + 3  # one lookup: 4 sequences and 3 earlier turns
    # Masks missing or of another length (a malformed group, dropped later): the sequence's own version only.
    assert versions_by_group(Ledger(), [{"tokens": [multi], "masks": [[P]]}]) == [[5]]  # type: ignore[arg-type]


def test_a_recipe_files_output_dir_names_each_launchs_folder(tmp_path):
    import yaml

    from trainer.orchestration.launcher import ROOT, parse_args, resolve_run

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"trainer": {"output_dir": str(tmp_path / "mine")}}))
    _, run_dir = resolve_run(parse_args(["toy", "--config", str(recipe)]))
    assert run_dir.name.startswith("mine-") and run_dir.parent == tmp_path
    recipe.write_text(yaml.safe_dump({"trainer": {"output_dir": "runs/nightly"}}))
    _, run_dir = resolve_run(parse_args(["toy", "--config", str(recipe)]))
    assert run_dir.parent == ROOT / "runs" and run_dir.name.startswith("nightly-")
    recipe.write_text(yaml.safe_dump({"rollout": {"num_steps": 3}}))
    _, run_dir = resolve_run(parse_args(["toy", "--config", str(recipe)]))
    assert run_dir.name.startswith("toy-")
    _, run_dir = resolve_run(
        parse_args(["toy", "--config", str(recipe), f"trainer.output_dir={tmp_path / 'x'}"])
    )
    assert run_dir == tmp_path / "x"
