"""The launcher's idle-run line names the likeliest cause from the components' own counts and logs."""

from __future__ import annotations

from trainer.orchestration.idle import Snapshot, explain_idle

LOG = "runs/x/logs/env.log"


def test_no_request_names_the_environment_and_its_log_hint():
    before = Snapshot(requests=10, rejected=0, queued=0)
    tail = "12:00 INFO started\n12:01 WARNING Scores are the same in a group, skipping...\n"
    line = explain_idle(200, before, Snapshot(requests=10, rejected=0, queued=0), 64, tail, LOG)
    assert "no training step for 200 s" in line and "sent the gateway no generation request" in line
    assert "ensure_scores_are_not_same" in line
    bare = explain_idle(200, before, Snapshot(requests=10, rejected=0, queued=0), 64, "", LOG)
    assert bare.endswith(f"read {LOG}")


def test_rejections_are_named_with_their_reason():
    now = Snapshot(
        requests=40,
        rejected=30,
        rejected_by_reason={"invalid_request": 30},
        last_rejection="400 /v1/chat/completions: stop must be strings",
    )
    line = explain_idle(300, Snapshot(requests=0, rejected=0), now, 64, "", LOG)
    assert "rejected 30 of 40 requests (invalid_request 30)" in line and "stop must be strings" in line


def test_sampling_without_groups_points_at_run_api_queue_and_env_errors():
    tail = "x ERROR environments.foo failed to score: KeyError 'answer'\n"
    line = explain_idle(
        200, Snapshot(requests=0, rejected=0), Snapshot(requests=50, rejected=0, queued=8), 64, tail, LOG
    )
    assert "served 50 requests" in line and "holds 8 sequences and a batch needs 64" in line
    assert "KeyError 'answer'" in line
    full = explain_idle(200, Snapshot(), Snapshot(requests=5, rejected=0, queued=64), 64, "", LOG)
    assert "the trainer took none" in full


def test_unreachable_components_still_give_a_line():
    assert explain_idle(181, Snapshot(), Snapshot(), 64, "", LOG).endswith(LOG)


def test_requests_held_at_the_gate_point_at_the_trainer():
    before = Snapshot(requests=10, rejected=0, queued=0)
    now = Snapshot.read({"requests_total": 10, "gate_waiting_for": 7, "gate_holding": 8}, {"queue_size": 0})
    line = explain_idle(200, before, now, 64, "", LOG)
    assert "holds 8 request(s) at the on-policy gate for version 7" in line and "trainer" in line
