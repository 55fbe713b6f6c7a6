"""Several environments in one run (`rollout.envs`): the config's checks and resolved entries, each environment's
command and share, the mixed run's run-api (atroposlib's batches by min_batch_allocation, /envs, a restarted
environment replacing its dead registration), and the trainer's per-environment rows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from trainer.orchestration.commands import build_components, env_command, env_share_lines
from trainer.orchestration.idle import Snapshot, explain_idle
from trainer.orchestration.preflight import check_environment
from trainer.training.batch import IntakeOptions, convert_batch, per_env_metrics
from trainer.training.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
RESIDUE = str(ROOT / "tests" / "envs" / "residue_tokens.py")
MIX = f"rollout.envs=[{{env: toy, weight: 3}}, {{env: {RESIDUE}, name: residue, weight: 1}}]"
BASE = ["rollout.group_size=8", "rollout.groups_per_step=8"]


def mixed(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, [*BASE, MIX, *overrides])


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(RunConfig, None, [*BASE, *overrides])
    return str(exc.value)


def test_entries_resolve_with_shares_and_the_rollout_defaults():
    specs = mixed("rollout.env_workers=2", "rollout.max_token_length=300").rollout.env_specs()
    assert [(s.name, s.weight, s.share, s.workers, s.max_token_length) for s in specs] == [
        ("toy", 3.0, 0.75, 2, 300),
        ("residue", 1.0, 0.25, 2, 300),
    ]
    alone = load_config(RunConfig, None, ["rollout.env=toy", "rollout.env_args={a: 1}"]).rollout.env_specs()
    assert [(s.name, s.share, s.env_args, s.group_size) for s in alone] == [("toy", 1.0, {"a": 1}, 8)]


@pytest.mark.parametrize(
    ("entries", "said"),
    [
        ("[{env: toy}, {env: toy}]", "name 'toy' is already rollout.envs.0's"),
        ("[{env: toy, weight: 0}]", "rollout.envs.0.weight: Input should be greater than 0"),
        ("[{env: toy, weight: -2}]", "rollout.envs.0.weight: Input should be greater than 0"),
        ("[{env: toy, weight: .nan}]", "rollout.envs.0.weight: Input should be a finite number"),
        ("[{env: toy, weight: .inf}]", "rollout.envs.0.weight: Input should be a finite number"),
        ("[{env: toy, group_size: 5}]", "group_size=5 does not divide the batch"),
        ("[{env: toy, name: 'a/b'}]", "rollout.envs.0.name"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(entries: str, said: str):
    assert said in refused(f"rollout.envs={entries}")


def test_rollout_env_and_rollout_envs_together_are_refused():
    assert "rollout.env='gsm8k' and rollout.envs are both set" in refused(
        "rollout.env=gsm8k", "rollout.envs=[{env: toy}]"
    )


def test_each_environment_gets_its_process_share_and_weight():
    two_workers = f"rollout.envs=[{{env: toy, weight: 3}}, {{env: {RESIDUE}, name: residue, workers: 2}}]"
    cfg = mixed(two_workers, "launch.run_api_url=http://api", "launch.gateway_url=http://gw")
    comps = {c.name: c.argv for c in build_components(cfg, Path("/run"), "/m")}
    assert list(comps) == ["run-api", "gateway", "env-toy", "env-residue-0", "env-residue-1", "trainer"]
    assert "trainer.orchestration.run_api:app" in comps["run-api"]
    toy, residue = comps["env-toy"], comps["env-residue-1"]
    assert "--env.min_batch_allocation=0.75" in toy and "--env.inference_weight=3.0" in toy
    assert "--env.wandb_name=toy-0" in toy
    # the bearer key that names each environment to the gateway's gate, shared by an environment's workers
    assert "--openai.api_key=rl-env:toy" in toy and "--openai.api_key=rl-env:residue" in residue
    # two workers split the environment's share; each registers under its own name
    assert "--env.min_batch_allocation=0.125" in residue and "--env.wandb_name=residue-1" in residue
    assert residue[2:4] == ["environments.upstream", RESIDUE]
    lines = env_share_lines(cfg)
    assert lines[0].startswith("environment toy: weight 3, share 0.750: run-api fills 48 of each batch's 64")
    assert "16 of each batch's 64 sequences from it first (2 groups of 8), 2 process(es)" in lines[1]
    assert len(lines) == 2  # the default max_staleness (3) keeps the extra group atroposlib queues
    assert "waits for the next one" in env_share_lines(mixed("rollout.max_staleness=1"))[2]
    assert env_share_lines(mixed("rollout.max_staleness=1", "publish.gate_quota=false"))[2].startswith(
        "rollout.max_staleness=1 with publish.gate_quota off: atroposlib"
    )
    assert (
        mixed("rollout.max_staleness=1").share_quota() and not mixed("rollout.max_staleness=2").share_quota()
    )
    assert "waits for the next one" in env_share_lines(mixed("rollout.max_staleness=0"))[2]
    assert "waits for the next one" in env_share_lines(mixed("rollout.max_staleness=1", "publish.gate=on"))[2]


def test_one_environment_keeps_its_command_and_atroposlib_app():
    cfg = load_config(RunConfig, None, ["rollout.env=toy"])
    comps = {c.name: c.argv for c in build_components(cfg, Path("/run"), "/m")}
    assert list(comps) == ["run-api", "gateway", "env", "trainer"]
    assert "atroposlib.api:app" in comps["run-api"]
    assert not any("min_batch_allocation" in a or "inference_weight" in a for a in comps["env"])
    assert comps["env"] == env_command(cfg, "/m", 0)


def test_preflight_names_the_unknown_environment_of_each_entry():
    cfg = mixed("rollout.envs=[{env: toy}, {env: nope}, {env: missing.py}]")
    problems = [p for spec in cfg.rollout.env_specs() for p in check_environment(cfg, "/m", spec)]
    assert len(problems) == 2, problems
    assert problems[0].startswith("rollout.envs.1.env: unknown environment 'nope'")
    assert problems[1] == "rollout.envs.2.env='missing.py': no such environment file"


@pytest.fixture
def run_api() -> Iterator[TestClient]:
    from trainer.orchestration.run_api import app

    client = TestClient(app)
    registration = {
        "wandb_group": "g",
        "wandb_project": "p",
        "batch_size": 16,
        "max_token_len": -1,
        "checkpoint_dir": "",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 10,
    }
    client.post("/register", json=registration)  # the module's app is shared: start from a clean state
    client.get("/reset_data")
    client.post("/register", json=registration)
    assert client.get("/batch").json() == {
        "batch": None
    }  # the trainer's first poll lets environments register
    yield client
    client.get("/reset_data")


def register(client: TestClient, name: str, share: float) -> int:
    body = {"max_token_length": 64, "desired_name": name, "weight": 1.0, "group_size": 4}
    answer = client.post("/register-env", json={**body, "min_batch_allocation": share}).json()
    env_id: int = answer["env_id"]
    return env_id


def send(client: TestClient, env_id: int, groups: int) -> None:
    for _ in range(groups):
        group = {"tokens": [[1, 2]] * 4, "masks": [[-100, 2]] * 4, "scores": [0, 1, 0, 1], "env_id": env_id}
        client.post("/scored_data", json=group)


def batch_env_ids(client: TestClient) -> list[int] | None:
    batch = client.get("/batch").json()["batch"]
    return None if batch is None else sorted(g["env_id"] for g in batch)


def test_run_api_composes_each_batch_by_share(run_api: TestClient):
    a, b = register(run_api, "a-0", 0.75), register(run_api, "b-0", 0.25)
    send(run_api, a, 8)  # a arrives first and fast: alone it would fill two batches
    assert batch_env_ids(run_api) is None  # b's share is missing: no batch yet
    send(run_api, b, 1)
    assert batch_env_ids(run_api) == [a, a, a, b]
    listed = run_api.get("/envs").json()["envs"]
    assert [(e["name"], e["connected"], e["queued_sequences"]) for e in listed] == [
        ("a-0", True, 20),
        ("b-0", True, 0),
    ]


def test_a_batch_waits_for_each_environments_whole_share_not_just_one_of_its_groups(run_api: TestClient):
    """atroposlib alone forms the batch once each environment has a group queued and fills the rest in queue
    order: here a's extra group would take the place of b's second, left over (and stale) for the next batch."""
    a, b = register(run_api, "a-0", 0.5), register(run_api, "b-0", 0.5)
    send(run_api, a, 3)  # a's share and an extra group (a refill after a discarded one)
    send(run_api, b, 1)  # b's episodes are longer: one of its two groups so far
    assert batch_env_ids(run_api) is None
    send(run_api, b, 1)
    assert batch_env_ids(run_api) == [a, a, b, b]
    queued = {e["name"]: e["queued_sequences"] for e in run_api.get("/envs").json()["envs"]}
    assert queued == {"a-0": 4, "b-0": 0}


def test_a_restarted_environment_replaces_its_dead_registration(run_api: TestClient):
    a, b = register(run_api, "a-0", 0.75), register(run_api, "b-0", 0.25)
    send(run_api, a, 3)
    restarted = register(run_api, "b-0", 0.25)  # b was killed (no /disconnect-env) and started again
    send(run_api, restarted, 1)
    # atroposlib alone would wait forever for the dead registration's share
    assert batch_env_ids(run_api) == [a, a, a, restarted]
    listed = {e["env_id"]: e["connected"] for e in run_api.get("/envs").json()["envs"]}
    assert listed == {a: True, b: False, restarted: True}


def group(env_id: int | None, scores: list[float], token: int = 5) -> dict:
    return {
        "tokens": [[1, token]] * len(scores),
        "masks": [[-100, token]] * len(scores),
        "scores": scores,
        "inference_logprobs": [[1.0, -0.5]] * len(scores),
        "env_id": env_id,
    }


def test_per_env_rows_count_what_each_environment_sent_trained_and_lost():
    taken = [
        group(0, [0.0, 1.0]),  # toy, trained
        group(0, [0.5, 0.5]),  # toy, zero variance
        group(1, [0.2, 0.4]),  # residue, dropped as stale
        group(1, [0.0, 1.0], token=999),  # residue, malformed (token outside the vocabulary)
        group(2, [0.0, 1.0]),  # residue after a restart, trained
    ]
    kept = [taken[0], taken[1], taken[3], taken[4]]
    converted = convert_batch(kept, IntakeOptions(vocab_size=100, max_seq_len=16))
    names = {0: "toy", 1: "residue", 2: "residue"}
    lags = [[0, 1], [0, 0], [1, 1], [0, 0]]
    row = per_env_metrics(taken, [(2, "stale")], kept, converted, names, ["toy", "residue", "idle"], lags)
    assert row["policy/toy/staleness_mean"] == 0.25 and row["policy/residue/staleness_mean"] == 0.5
    assert row["rollouts/toy/sequences_received"] == 4 and row["rollouts/residue/sequences_received"] == 6
    assert row["rollouts/toy/sequences_trained"] == 2 and row["rollouts/residue/sequences_trained"] == 2
    assert row["rollouts/toy/sequences_zero_variance"] == 2
    assert row["rollouts/residue/sequences_dropped_stale"] == 2
    assert row["rollouts/residue/sequences_dropped_malformed"] == 2
    assert row["rollouts/toy/share_trained"] == 0.5
    assert row["reward/toy/mean"] == pytest.approx(0.5)
    assert row["reward/residue/mean"] == pytest.approx(0.5)  # the scores it sent that passed the checks
    assert row["rollouts/idle/sequences_received"] == 0 and row["reward/idle/mean"] is None
    assert "rollouts/toy/sequences_truncated" not in row and "rollouts/toy/kept_unknown_version" not in row
    # residue's trained group: one sequence the ledger never knew (kept unknown), both longer than max_seq_len 3
    long = {**group(2, [0.0, 1.0]), "tokens": [[1, 5, 5, 5]] * 2, "masks": [[-100, 5, 5, 5]] * 2}
    long["inference_logprobs"] = [[1.0, -0.5, -0.5, -0.5]] * 2
    short = convert_batch([taken[0], long], IntakeOptions(vocab_size=100, max_seq_len=3))
    row = per_env_metrics(
        [taken[0], long], [], [taken[0], long], short, names, ["toy", "residue"], [[0, 0], [0]]
    )
    assert (
        row["rollouts/residue/sequences_truncated"] == 2 and row["rollouts/residue/kept_unknown_version"] == 1
    )
    assert "rollouts/toy/sequences_truncated" not in row and "rollouts/toy/kept_unknown_version" not in row
    unnamed = per_env_metrics(
        [group(7, [0.0, 1.0])], [], [], convert_batch([], IntakeOptions(100, 16)), {}, []
    )
    assert unnamed["rollouts/unknown/sequences_received"] == 2


def test_idle_line_names_the_environment_that_holds_the_batch(run_api: TestClient):
    a, b = register(run_api, "toy-0", 0.75), register(run_api, "residue-0", 0.25)
    send(run_api, a, 3)
    status = run_api.get("/status").json()  # what the launcher polls
    assert status["queue_size"] == 3 and len(status["envs"]) == 2
    before = Snapshot.read({"requests_total": 10, "rejected_total": 0}, status)
    now = Snapshot.read({"requests_total": 20, "rejected_total": 0}, status)
    line = explain_idle(200, before, now, 16, "", "logs/env-toy.log")
    assert "1 lack theirs: residue (residue-0: 0 of its 4 sequences queued)" in line, line
    send(run_api, b, 1)
    assert "lack theirs" not in explain_idle(
        200, before, Snapshot.read({}, run_api.get("/status").json()), 16, "", ""
    )


def test_an_environment_sending_nothing_holds_batches_only_for_mix_wait_s_and_its_shortfall_is_counted(
    run_api: TestClient, monkeypatch
):
    from trainer.orchestration import run_api as module

    monkeypatch.setattr(module, "MIX_WAIT_S", 0.3)
    monkeypatch.setattr(module, "waiting_since", None)
    monkeypatch.setattr(module, "shortfall", {})
    a, b = register(run_api, "toy-0", 0.75), register(run_api, "residue-0", 0.25)
    send(run_api, a, 4)  # residue is stopped (SIGSTOP, a slow scorer): it sends nothing
    assert batch_env_ids(run_api) is None  # within mix_wait_s its share still holds the batch
    time.sleep(0.4)
    assert batch_env_ids(run_api) == [a, a, a, a]  # then the others fill it
    listed = {e["name"]: e for e in run_api.get("/envs").json()["envs"]}
    assert (listed["residue-0"]["short_batches"], listed["residue-0"]["shortfall_sequences"]) == (1, 4)
    assert listed["toy-0"]["short_batches"] == 0
    assert listed["residue-0"]["min_batch_allocation"] == 0.25  # its share is back for the next batch
    send(run_api, a, 2)  # each environment queues about its own share only: not enough for a whole batch
    assert batch_env_ids(run_api) is None
    time.sleep(0.4)
    assert batch_env_ids(run_api) == [a, a]  # a short batch of what is queued
    send(run_api, a, 3)
    send(run_api, b, 1)
    assert batch_env_ids(run_api) == [a, a, a, b]  # it sends again: an ordinary batch, nothing more counted
    residue = run_api.get("/envs").json()["envs"][1]
    assert (residue["short_batches"], residue["shortfall_sequences"]) == (2, 8)


def test_a_mixed_run_gives_the_gate_each_environments_share(monkeypatch):
    from trainer.training import loop

    asked: list[tuple] = []

    class Gateway:
        def expect(self, *args):
            asked.append(args)

    loop._close_gate(mixed("rollout.max_staleness=0"), Gateway(), 3)  # type: ignore[arg-type]
    assert asked[-1][4:7] == ({"toy": 48, "residue": 16}, 0, False)  # run-api's allotments (env_share_lines)
    assert asked[-1][7:] == (8, {"toy": 8, "residue": 8})  # what a prompt's first request reserves
    uneven = f"rollout.envs=[{{env: toy, weight: 2}}, {{env: {RESIDUE}, name: residue, weight: 1}}]"
    loop._close_gate(mixed(uneven, "rollout.max_staleness=0"), Gateway(), 3)  # type: ignore[arg-type]
    assert asked[-1][4] == {"toy": 48, "residue": 24}  # 42.7 and 21.3 sequences, up to whole groups of 8
    # Without the gate (max_staleness 1) the environments may sample one batch ahead while the trainer trains.
    loop._close_gate(mixed("rollout.max_staleness=1"), Gateway(), 3, batch_taken=True)  # type: ignore[arg-type]
    assert asked[-1][4:7] == ({"toy": 48, "residue": 16}, 1, True)
    loop._close_gate(mixed("publish.gate_quota=false"), Gateway(), 3)  # type: ignore[arg-type]
    assert asked[-1][2] is None and asked[-1][4] is None
    loop._close_gate(load_config(RunConfig, None, BASE), Gateway(), 3)  # type: ignore[arg-type]
    assert asked[-1][2] == 64 and asked[-1][4] is None  # one environment: the batch's quota is its own
