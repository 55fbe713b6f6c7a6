"""The report in every run folder (`python -m trainer report RUN_DIR`, written by the launcher however a run ends)
and the readers' bad input: a half-written last line, no metrics file, an empty run, rows with None, missing keys
or values that are not numbers. Synthetic run folders in tmp_path; matplotlib draws with Agg."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainer.orchestration import launcher
from trainer.orchestration.supervisor import LaunchError
from trainer.readout import report, summary
from trainer.readout.plots import thin
from trainer.readout.runfolder import ELAPSED, EVENTS, number, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"
ALWAYS = [p.filename for p in report.RUN_PANELS if not p.skip_empty]


def row(step: int, **extra: Any) -> dict[str, Any]:
    """A metrics row shaped like the trainer's, with the keys the report plots."""
    return {
        "step": step,
        "policy_version": step,
        "reward/mean": min(1.0, 0.1 + 0.03 * step),
        "loss": 0.5 / step,
        "optim/grad_norm": 1.0 / step,
        "importance/mismatch_kl": 1e-4,
        "importance/logprob_diff_mean": 0.01,
        "policy/staleness_max": 1.0,
        "policy/staleness_mean": 0.5,
        "rollouts/dropped_stale": float(step % 7 == 0) * 8,
        "rollouts/sequences_taken": 64.0,
        "time/step_s": 1.0,
        "time/wait_for_batch_s": 0.4,
        "time/train_s": 0.5,
        "time/publish_s": 0.1,
        "perf/tokens_per_s": 2000.0,
        "wall_s": 1.0 * step,
        "unix_time": 1_800_000_000.0 + step,
        "faults/restarts_trainer": 0.0,
        **extra,
    }


def make_run(folder: Path, rows: list[dict[str, Any]] | None, num_steps: int = 30, tail: str = "") -> Path:
    """A run folder as launch.sh leaves it: config.yaml, metrics.jsonl (None: none written), a checkpoint and
    adapters; `tail` is appended to the metrics as it is (a half-written line)."""
    folder.mkdir(parents=True)
    config = {"rollout": {"num_steps": num_steps}, "model": {"path": "tiny"}, "launch": {"backend": "local"}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    if rows is not None:
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if rows:
        last = rows[-1]["step"]
        (folder / "checkpoints" / f"step-{last:06d}").mkdir(parents=True)
        (folder / "checkpoints" / "latest").write_text(f"step-{last:06d}")
        for v in range(1, 4):
            (folder / "adapters" / f"v{v:06d}").mkdir(parents=True)
    return folder


def written(folder: Path) -> tuple[str, dict[str, Any]]:
    out = folder / "report"
    for name in ALWAYS:
        assert (out / name).read_bytes()[:8] == PNG, name
    return (out / "report.md").read_text(), json.loads((out / "summary.json").read_text())


def test_a_run_folder_gets_its_report_and_a_rerun_rewrites_it(tmp_path, capsys):
    run = make_run(tmp_path / "run", [row(s) for s in range(1, 21)])
    evals = [
        {"step": 0, "status": "ok", "target": "base", "eval/pass@1": 0.1, "unix_time": 1.0},
        {"step": 10, "status": "failed", "target": "step 10", "reason": "timeout", "unix_time": 2.0},
        {"step": 20, "status": "ok", "target": "step 20", "eval/pass@1": 0.9, "unix_time": 3.0},
    ]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals) + "{half a line")
    assert report.main([str(run), "--ended", "stopped by SIGTERM"]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report" / "report.md")
    page, facts = written(run)
    assert "| ended | stopped by SIGTERM |" in page and "| steps | 20 of 30 |" in page
    assert "final 0.7 (step 20), best 0.7 (step 20)" in page
    assert f"{run / 'checkpoints'} (a resume loads step-000020)" in page
    assert "3 versions, newest v000003" in page and "| restarts and faults | none |" in page
    assert (run / "report" / "eval.png").read_bytes()[:8] == PNG  # drawn only where a run has evaluations
    assert (
        "| held-out eval | step 0: pass@1 0.1 -> step 20: pass@1 0.9 (3 evaluations, 1 failed, 0 skipped while one ran); failed: step 10: timeout |"
        in page
    )
    assert facts["eval"]["last"] == {"step": 20, "pass@1": 0.9} and "eval.jsonl line 4 is not JSON" in page
    assert facts["steps_done"] == 20 and facts["summary"]["step_s_median"] == 1.0
    # The resumed run ends: the same folder, rewritten whole (no --ended: finished is read from the step count).
    (run / "metrics.jsonl").write_text("".join(json.dumps(row(s)) + "\n" for s in range(1, 31)))
    assert report.main([str(run)]) == 0
    page, facts = written(run)
    assert (
        "| ended | finished |" in page
        and "| steps | 30 of 30 |" in page
        and facts["reward_final"] == pytest.approx(1.0)
    )
    assert not [p for p in (run / "report").iterdir() if p.name.startswith(".")]  # no temp file left


def test_a_half_written_last_line_is_read_as_far_as_it_goes(tmp_path, capsys):
    rows = [row(s) for s in range(1, 6)]
    run = make_run(tmp_path / "run", rows, tail='{"step": 6, "reward/me')
    lines = (run / "metrics.jsonl").read_text().split("\n")
    lines.insert(2, "{not json")  # and a line in the middle that is not JSON
    (run / "metrics.jsonl").write_text("\n".join(lines))
    metrics = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in metrics.rows] == [1, 2, 3, 4, 5]
    assert any("last line (7) is half-written" in p for p in metrics.problems), metrics.problems
    assert any("1 line(s) are not JSON objects" in p and "line 3" in p for p in metrics.problems)
    assert report.main([str(run)]) == 0
    page, facts = written(run)
    assert "| steps | 5 of 30 |" in page and "half-written" in page and facts["ended"] is None
    capsys.readouterr()
    assert summary.main([str(run)]) == 0
    out = json.loads(capsys.readouterr().out)[str(run)]
    assert out["steps"] == 5 and "half-written" in out["problems"][0]


def test_a_folder_without_metrics_is_reported_and_a_missing_folder_is_an_error(tmp_path, capsys):
    run = make_run(tmp_path / "run", None)
    assert report.main([str(run)]) == 0
    page, facts = written(run)
    assert "| steps | 0 of 30 |" in page and "no metrics.jsonl" in page and facts["reward_final"] is None
    capsys.readouterr()
    assert summary.main([str(run)]) == 0
    assert "no metrics.jsonl" in json.loads(capsys.readouterr().out)[str(run)]["problems"][0]
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert summary.main([str(tmp_path / "nowhere")]) == 2


def test_an_empty_run_is_reported(tmp_path, capsys):
    run = make_run(tmp_path / "run", [])
    (run / "config.yaml").write_text("rollout: [1,")  # and a config that cannot be read
    assert report.main([str(run)]) == 0
    page, facts = written(run)
    assert "| steps | 0 of ? |" in page and "config.yaml cannot be read" in page
    assert facts["wall_s"] is None and facts["segments"] == 0
    capsys.readouterr()
    assert summary.main([str(run)]) == 0
    assert json.loads(capsys.readouterr().out)[str(run)]["steps"] == 0


def test_rows_with_none_missing_keys_or_odd_values(tmp_path, capsys):
    rows = [row(s) for s in range(1, 7)]
    rows[1].update({"reward/mean": None, "loss": None, "time/publish_s": None, "policy_version": None})
    rows[2] = {"step": 3, "wall_s": 3.0}  # a row with almost nothing
    rows[3].update({"optim/grad_norm": math.nan, "perf/tokens_per_s": "fast", "time/train_s": True})
    rows[4].pop("policy/staleness_mean")
    run = make_run(tmp_path / "run", rows, num_steps=6)
    assert report.main([str(run)]) == 0
    page, facts = written(run)
    assert "| steps | 6 of 6 |" in page and "| ended | finished |" in page
    assert facts["reward_best"] == pytest.approx(0.28) and facts["reward_best_step"] == 6
    capsys.readouterr()
    assert summary.main([str(run)]) == 0
    out = json.loads(capsys.readouterr().out)[str(run)]
    assert out["steps"] == 6 and out["updates"] == 4 and out["final_policy_version"] == 6
    assert out["staleness_mean"] == 0.5 and out["train_s_median"] == 0.5
    assert [number({"v": v}, "v") for v in (True, "1", math.inf, math.nan, None, 2)] == [None] * 5 + [2.0]


def test_a_resumed_run_sums_its_wall_time_and_counts_faults_across_launches(tmp_path):
    """The trainer's clock starts at 0 in each segment; the launcher's fault counts start again in a resumed run."""
    rows = [row(s) for s in range(1, 7)]
    for r, wall, restarts in zip(rows, [1, 2, 3, 1, 2, 3], [0, 1, 1, 1, 0, 2], strict=True):
        r.update({"wall_s": float(wall), "faults/restarts_trainer": float(restarts)})
    metrics = read_metrics(make_run(tmp_path / "run", rows) / "metrics.jsonl")
    assert [r[ELAPSED] for r in metrics.rows] == [1, 2, 3, 4, 5, 6] and metrics.segments == 2
    assert [r[EVENTS + "restarts_trainer"] for r in metrics.rows] == [0, 1, 1, 1, 1, 3]
    assert [r[EVENTS + "trainer_starts"] for r in metrics.rows] == [1, 1, 1, 2, 2, 2]
    assert metrics.fault_totals == {"restarts_trainer": 3.0}
    assert summary.summarize(metrics.rows)["wall_s"] == 6.0  # not the last segment's 3 s


def test_long_runs_are_thinned_keeping_their_spikes():
    xs = [float(i) for i in range(100_000)]
    ys = [1000.0 if i == 54_321 else math.sin(i) for i in range(100_000)]
    tx, ty = thin(xs, ys, limit=400)
    assert len(tx) <= 400 and max(ty) == 1000.0 and tx == sorted(tx)


def test_the_launcher_writes_the_report_however_the_run_ends(tmp_path, monkeypatch):
    cfg = launcher.load_config(launcher.RunConfig, launcher.ROOT / "configs" / "tiny_cpu.yaml", [])
    handler = signal.getsignal(signal.SIGTERM)
    ended: list[str] = []
    monkeypatch.setattr(launcher, "preflight", lambda cfg: "model")
    monkeypatch.setattr(launcher, "check_memory", lambda cfg, model: None)
    monkeypatch.setattr(launcher, "write_run_folder", lambda *a: [])
    monkeypatch.setattr(launcher, "start_all", lambda *a: None)
    monkeypatch.setattr(launcher, "stop_all", lambda components: ended.append("stopped the rest"))
    monkeypatch.setattr(launcher, "start_report", lambda run_dir, how: ended.append(how) or "not started")
    monkeypatch.setattr(launcher, "finish_report", lambda run_dir, report: None)

    def supervised(outcome: str):
        class Supervisor:
            def __init__(self, *a: Any) -> None:
                pass

            def run(self) -> int:
                if outcome == "signal":
                    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's own handler takes it
                if outcome == "fails":
                    raise LaunchError("trainer exited with code 1 and restarts are off\nmore")
                return 0

        return Supervisor

    monkeypatch.setattr(launcher, "Supervisor", supervised("finishes"))
    assert launcher.launch(cfg, tmp_path, dry_run=False, resumed=False) == 0
    monkeypatch.setattr(launcher, "Supervisor", supervised("signal"))
    assert launcher.launch(cfg, tmp_path, dry_run=False, resumed=False) == 128 + signal.SIGTERM
    monkeypatch.setattr(launcher, "Supervisor", supervised("fails"))
    with pytest.raises(LaunchError):
        launcher.launch(cfg, tmp_path, dry_run=False, resumed=False)
    # With the trainer gone (here: none started), the report is started before the other components stop.
    assert ended == [
        "finished",
        "stopped the rest",
        "stopped by SIGTERM",
        "stopped the rest",
        "failed: trainer exited with code 1 and restarts are off",
        "stopped the rest",
    ]
    assert signal.getsignal(signal.SIGTERM) is handler  # the launcher put its handlers back


class FakeReportProcess:
    """subprocess.Popen for the report child: `answer(argv, timeout)` gives (returncode, stdout, stderr) or raises."""

    answer: Any = None

    def __init__(self, argv: list[str], **kw: Any) -> None:
        self.argv, self.returncode, self.killed = argv, None, False

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self.killed:
            return "", ""
        self.returncode, out, err = type(self).answer(self.argv, timeout)
        return out, err

    def kill(self) -> None:
        self.killed = True


def test_the_launchers_report_step_is_one_line_whatever_happens(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "run", [row(1)])

    def in_process(argv: list[str], timeout: float) -> tuple[int, str, str]:
        assert argv[1:3] == ["-m", "trainer.readout.report"] and timeout == launcher.REPORT_TIMEOUT_S
        code = report.main(argv[3:])
        return code, capsys.readouterr().out, ""

    monkeypatch.setattr(launcher.subprocess, "Popen", FakeReportProcess)
    FakeReportProcess.answer = in_process
    launcher.finish_report(run, launcher.start_report(run, "stopped by SIGINT"))
    assert capsys.readouterr().out == f"report: {run / 'report' / 'report.md'}\n"
    assert "| ended | stopped by SIGINT |" in (run / "report" / "report.md").read_text()

    def fails(argv: list[str], timeout: float) -> tuple[int, str, str]:
        return 1, "", "Traceback ...\nValueError: bad\n"

    def hangs(argv: list[str], timeout: float) -> tuple[int, str, str]:
        raise subprocess.TimeoutExpired(argv, timeout)

    def interrupted(argv: list[str], timeout: float) -> tuple[int, str, str]:
        raise KeyboardInterrupt

    timeout = f"took over {launcher.REPORT_TIMEOUT_S:.0f} s"
    for fake, said in [(fails, "ValueError: bad"), (hangs, timeout), (interrupted, "cut short")]:
        FakeReportProcess.answer = fake
        launcher.finish_report(run, launcher.start_report(run, "finished"))
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and said in out and "python -m trainer report" in out, out

    def cannot_start(argv: list[str], **kw: Any) -> None:
        raise OSError("no such interpreter")

    monkeypatch.setattr(launcher.subprocess, "Popen", cannot_start)
    launcher.finish_report(run, launcher.start_report(run, "finished"))
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no report (no such interpreter)" in out, out


def test_the_help_says_where_one_runs_report_goes(capsys):
    with pytest.raises(SystemExit):
        report.main(["--help"])
    assert "RUN_DIR/report" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # several runs need a folder to share
        report.main(["a", "b"])
    assert "needs --out DIR" in capsys.readouterr().err
