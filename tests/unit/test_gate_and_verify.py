"""The on-policy gate and publish verification in the gateway, against a scripted sampler (the real-vLLM checks
are in test_gateway_vllm.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inference.policy.gate import Gate
from inference.policy.probe_check import compare_probe
from inference.policy.registry import Policy
from tests.scripted_gateway import ScriptedBackend, client_for, make_adapter, publish_body
from trainer.training.publishing import FLOAT32_TOLERANCE, LOW_PRECISION_TOLERANCE

GEN = {"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 4}


def test_probe_compare_skips_edge_ids_and_needs_overlap():
    want = [{5: -0.1, 6: -2.0, 7: -3.0}, {1: -0.5, 2: -1.0}]
    same = compare_probe(want, [{5: -0.1000004, 6: -2.0, 7: -3.0}, {1: -0.5, 2: -1.0}], 1e-4)
    assert same.passed and same.compared == 5
    # A near-tie at the edge of the top-k: id 7 and id 8 swap places; the shared ids are compared.
    edge = compare_probe(want, [{5: -0.1, 6: -2.0, 8: -3.0}, {1: -0.5, 2: -1.0}], 1e-4)
    assert edge.passed and edge.compared == 4
    moved = compare_probe(want, [{5: -0.1, 6: -2.05, 7: -3.0}, {1: -0.5, 2: -1.0}], 1e-3)
    assert not moved.passed and moved.max_abs_diff == pytest.approx(0.05) and moved.worst_prompt == 0
    assert "0.05" in moved.describe() and "tolerance" in moved.describe()
    other = compare_probe(want, [{5: -0.1, 6: -2.0, 7: -3.0}, {3: -0.5, 4: -1.0}], 1e-3)
    assert not other.passed and other.worst_prompt == 1  # a different next-token distribution altogether
    assert not compare_probe(want, [], 1e-3).passed


async def test_gate_holds_until_opened_and_expires_by_itself():
    gate = Gate()
    assert await gate.wait() == 0.0  # open: no wait
    gate.close(1, hold_s=5.0)
    waiter = asyncio.create_task(gate.wait())
    await asyncio.sleep(0.05)
    assert not waiter.done() and gate.holding == 1
    spell = gate.open()
    assert spell is not None and spell.version == 1 and spell.held_requests == 1 and not spell.expired
    assert await waiter >= 0.04
    gate.close(2, hold_s=0.1)
    late = asyncio.create_task(gate.wait())
    await asyncio.sleep(0.3)
    assert late.done() and gate.waiting_for is None and gate.expired_total == 1
    assert gate.last is not None and gate.last.expired


async def test_requests_wait_for_the_expected_version_and_are_served_on_it(tmp_path):
    backend = ScriptedBackend()
    client, _ = client_for(backend)
    async with client:
        a1 = make_adapter(tmp_path, "a1")
        r = await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        assert r.json() == {"holding_for": 1, "hold_s": 0.0, "held_requests": 0}
        held = [asyncio.create_task(client.post("/generate", json=GEN)) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in held)
        status = (await client.get("/policy")).json()
        assert status["gate_waiting_for"] == 1 and status["gate_holding"] == 3
        published = (await client.post("/policy/publish", json=publish_body(1, a1))).json()
        assert published["held_requests"] == 3 and published["hold_s"] >= 0.2
        for t in held:
            reply = await t
            assert reply.status_code == 200 and reply.headers["x-policy-version"] == "1"
        assert (await client.get("/policy")).json()["gate_waiting_for"] is None


async def test_an_in_flight_request_finishes_on_the_old_version(tmp_path):
    backend = ScriptedBackend()
    backend.gate = asyncio.Event()  # the sampler holds this request mid-generation
    client, _ = client_for(backend)
    async with client:
        running = asyncio.create_task(client.post("/generate", json=GEN))
        await asyncio.sleep(0.1)
        await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        backend.gate.set()
        assert (await running).headers["x-policy-version"] == "0"


async def test_a_step_without_update_opens_the_gate(tmp_path):
    client, _ = client_for(ScriptedBackend())
    async with client:
        await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        held = asyncio.create_task(client.post("/generate", json=GEN))
        await asyncio.sleep(0.1)
        opened = (await client.post("/policy/expect", json={"version": 0})).json()
        assert opened["holding_for"] is None and opened["held_requests"] == 1
        assert (await held).headers["x-policy-version"] == "0"


@pytest.mark.parametrize(
    "body",
    [{"version": -1}, {"version": 1, "hold_s": 0}, {"version": 1, "hold_s": 1e9}, {"version": "1"}, {"v": 1}],
)
async def test_expect_refuses_bad_bodies(body):
    client, _ = client_for(ScriptedBackend())
    async with client:
        r = await client.post("/policy/expect", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"]


async def test_expect_needs_the_publish_token():
    client, _ = client_for(ScriptedBackend(), publish_token="s3cret-token-value")
    async with client:
        r = await client.post("/policy/expect", json={"version": 1})
        assert r.status_code == 401


class ProbedBackend(ScriptedBackend):
    """Answers a probe with top logprobs {1: -0.1, 2: -0.2 - 0.1 * version}: each version its own distribution."""

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        top = {"token_id:1": -0.1, "token_id:2": -0.2 - 0.1 * policy.version}
        choice = {"logprobs": {"top_logprobs": [top]}, "token_ids": [1]}
        return {"choices": [{"index": i, **choice} for i in range(len(body["prompt"]))]}


def probe(version: int, shift: float = 0.0, tolerance: float = 1e-3) -> dict:
    top = {"1": -0.1, "2": -0.2 - 0.1 * version + shift}
    return {"prompts": [[3, 4], [5, 6]], "top_logprobs": [top, top], "tolerance": tolerance}


async def test_a_verified_publish_serves_and_reports_the_difference(tmp_path):
    client, _ = client_for(ProbedBackend())
    async with client:
        body = publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": probe(1, shift=5e-4)}
        r = await client.post("/policy/publish", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["verify_max_abs_diff"] == pytest.approx(5e-4) and r.json()["verify_s"] >= 0


async def test_a_wrong_adapter_is_refused_unloaded_and_never_served(tmp_path):
    backend = ProbedBackend()
    client, reg = client_for(backend)
    async with client:
        await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        # The trainer's logprobs are those of version 2's weights: not what was loaded as version 1.
        body = publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": probe(2)}
        r = await client.post("/policy/publish", json=body)
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["type"] == "verification_failed" and err["max_abs_diff"] == pytest.approx(0.1)
        assert "version 1" in err["message"] and "tolerance" in err["message"]
        assert reg.current.version == 0 and backend.unloaded == ["policy-v1"]
        # The gate still waits for version 1: a retried publish (the adapter written again) opens it.
        assert (await client.get("/policy")).json()["gate_waiting_for"] == 1
        retry = publish_body(1, make_adapter(tmp_path, "a1-again")) | {"probe": probe(1)}
        assert (await client.post("/policy/publish", json=retry)).status_code == 200
        assert reg.current.version == 1
        assert (await client.get("/policy")).json()["gate_waiting_for"] is None


@pytest.mark.parametrize(
    "bad",
    [
        {"prompts": [[3, 4]]},
        {"top_logprobs": [{"1": 0.5}, {"1": -0.1}]},
        {"top_logprobs": [{"1": float("nan")}, {"1": -0.1}]},
        {"top_logprobs": [{}, {"1": -0.1}]},
        {"tolerance": 0},
        {"prompts": [[], [1]]},
    ],
)
async def test_malformed_probes_are_a_400(tmp_path, bad):
    client, _ = client_for(ProbedBackend())
    async with client:
        body = publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": probe(1) | bad}
        r = await client.post("/policy/publish", content=json.dumps(body, allow_nan=True))
        assert r.status_code == 400, r.text


async def test_quota_holds_the_next_batch_for_the_next_version_and_refills_when_short():
    running = {"n": 0}
    gate = Gate(lambda: running["n"])
    gate.set_quota(16, refill_s=0.2)
    gate.open()  # a fresh version with its quota
    assert await gate.wait(8) == 0.0 and await gate.wait(8) == 0.0
    over = asyncio.create_task(gate.wait(8))  # the environment starting the next batch early
    await asyncio.sleep(0.05)
    assert not over.done() and gate.holding == 1
    # The trainer takes the batch and publishes: the early request samples the new version.
    gate.close(2, hold_s=30)
    await asyncio.sleep(0.3)  # no refill while the gate waits for a version
    assert not over.done()
    gate.open()
    assert await over > 0.3
    # An environment that discarded groups is short of a batch: with nothing running, a refill lets it go on.
    await gate.wait(8)
    running["n"] = 1
    short = asyncio.create_task(gate.wait(16))
    await asyncio.sleep(0.3)
    assert not short.done()  # something still runs on this version: its group may complete the batch
    running["n"] = 0
    gate.request_done()
    await asyncio.sleep(0.3)
    assert short.done() and gate.refills_total == 1


async def test_the_timed_refill_waits_out_an_episode_between_two_turns():
    """A 3-turn episode has nothing running between its turns; refilled in such a gap, the environment would start
    a group beyond its share, stale in the next batch. The refill comes only after refill_s with nothing run."""
    running = {"n": 0}
    gate = Gate(lambda: running["n"])
    gate.set_quota(8, refill_s=0.6)  # five times the gaps below: a loaded box stretches a sleep
    gate.open()
    assert await gate.wait(8, "multi") == 0.0  # the episodes' first turns: the whole quota
    gate.request_started("multi")
    held = asyncio.create_task(gate.wait(8, "multi"))  # the next group, early
    await asyncio.sleep(0.05)
    for _ in range(4):  # turn after turn, each gap shorter than refill_s
        gate.request_done("multi")
        await asyncio.sleep(0.1)
        assert not held.done() and gate.refills_total == 0
        gate.request_started("multi")
    gate.request_done("multi")  # the episodes ended (and their group was discarded): quiet from now on
    await asyncio.sleep(0.2)
    assert not held.done()
    await asyncio.sleep(0.8)
    assert held.done() and gate.refills_total == 1


async def test_a_group_asked_for_one_rollout_at_a_time_starts_whole_on_one_version():
    """verifiers asks once per rollout: admitted request by request, the quota's last group would start partly on
    this version and partly on the next, and be stale as a whole. The first request of a prompt reserves its group."""
    gate = Gate()
    gate.set_quota(8, refill_s=30, group_size=4)
    gate.open()
    # Three groups' first rollouts arrive interleaved, as concurrent rollouts do.
    assert await gate.wait(1, None, "A") == 0.0 and await gate.wait(1, None, "B") == 0.0  # 2 x 4 reserved
    held_c = [asyncio.create_task(gate.wait(1, None, "C")) for _ in range(4)]
    for _ in range(3):
        assert await gate.wait(1, None, "A") == 0.0 and await gate.wait(1, None, "B") == 0.0
    late_a = asyncio.create_task(gate.wait(1, None, "A"))  # a fifth sample of A: past its group, a new group
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in held_c) and not late_a.done() and gate.group_passes_total == 6
    gate.close(2, hold_s=30)
    gate.open()
    await asyncio.gather(*held_c, late_a)
    assert gate.started_by_env() == {"": 8}  # C's group and A's fifth sample (a new group of 4)
    # A request for a whole group (ManagedServer's n = group_size) reserves nothing more.
    gate.close(3, hold_s=30)
    gate.open()
    assert await gate.wait(4, None, "D") == 0.0 and await gate.wait(4, None, "E") == 0.0
    more_d = asyncio.create_task(gate.wait(1, None, "D"))
    await asyncio.sleep(0.05)
    assert not more_d.done()
    more_d.cancel()


async def test_a_reservation_no_other_sample_used_goes_back_to_the_quota_when_its_request_ends():
    """An eval prompt asked for once (n = 1) reserves a group like any first rollout; once it ends with no sibling
    having come, the quota gets the reservation back. A group whose siblings came keeps it."""
    gate = Gate()
    gate.set_quota(8, refill_s=30, group_size=4)
    gate.open()
    assert await gate.wait(1, None, "eval-1") == 0.0 and await gate.wait(1, None, "A") == 0.0
    gate.request_started(None, "eval-1")
    gate.request_started(None, "A")
    assert await gate.wait(1, None, "A") == 0.0  # A's sibling
    gate.request_started(None, "A")
    held = asyncio.create_task(gate.wait(3))  # 8 of 8 reserved: a request for 3 more waits
    await asyncio.sleep(0.05)
    assert not held.done()
    gate.request_done(None, "eval-1")  # nothing else of eval-1 came: its 3 unused samples go back
    await asyncio.wait_for(held, 1)
    assert gate.released_total == 3 and gate.started_by_env() == {"": 8}  # eval-1 1, A 4 (reserved), then 3
    gate.request_done(None, "A")
    gate.request_done(None, "A")
    assert gate.released_total == 3  # A's siblings used its reservation: nothing to give back


async def test_a_groups_late_rollouts_after_its_reservation_went_back_are_not_stuck_until_the_deadline():
    """A client that sends a group's rollouts one after another: the first ends before the second comes, so its
    reservation goes back; later ones, held over the quota, must fit what the timed refill lifts (the samples
    held), not a whole group each."""
    gate = Gate()
    gate.set_quota(8, refill_s=0.05, group_size=4, hold_s=30)
    gate.open()
    assert await gate.wait(1, None, "A") == 0.0
    gate.request_started(None, "A")
    gate.request_done(None, "A")  # nothing else of A came yet: 3 samples go back
    for _ in range(4):
        assert await gate.wait(1, None, "B") == 0.0  # B: 4 reserved, then used
    assert await gate.wait(1, None, "C") == 0.0  # C: what the quota has left, 3, is reserved
    late = [asyncio.create_task(gate.wait(1, None, "A")) for _ in range(3)]  # A's other rollouts, late
    await asyncio.sleep(1.0)  # the timed refill lets them through, far inside their 30 s hold
    assert all(t.done() for t in late) and gate.deadline_passes_total == 0 and gate.refills_total >= 1


async def test_the_rest_of_a_group_passes_the_closed_gate_on_its_version():
    gate = Gate()
    gate.set_quota(8, refill_s=30, env_quotas={"multi": 8}, env_group_sizes={"multi": 4})
    gate.open()
    assert await gate.wait(1, "multi", "A") == 0.0
    gate.close(2, hold_s=30)  # the trainer took its batch meanwhile
    assert await gate.wait(1, "multi", "A") == 0.0  # A's rest, on A's version: split, A would be stale
    fresh = asyncio.create_task(gate.wait(1, "multi", "B"))
    await asyncio.sleep(0.05)
    assert not fresh.done()
    gate.open()
    assert await fresh > 0


async def test_a_request_larger_than_the_quota_still_starts_on_a_fresh_version():
    gate = Gate()
    gate.set_quota(4, refill_s=1.0)
    gate.open()
    assert await gate.wait(64) == 0.0


async def test_the_gateway_applies_the_quota_per_version(tmp_path):
    client, _ = client_for(ScriptedBackend())
    async with client:
        r = await client.post("/policy/expect", json={"version": 0, "quota": 2, "refill_s": 30})
        assert r.status_code == 200 and r.json()["holding_for"] is None
        body = {"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 4, "n": 2}
        assert (await client.post("/generate", json=body)).headers["x-policy-version"] == "0"
        early = asyncio.create_task(client.post("/generate", json=body))
        await asyncio.sleep(0.2)
        assert not early.done()
        await client.post("/policy/expect", json={"version": 1, "quota": 2, "refill_s": 30})
        await client.post("/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")))
        assert (await early).headers["x-policy-version"] == "1"


async def test_each_environment_of_a_mixed_run_starts_only_its_own_share_per_version():
    running = {"n": 0}
    gate = Gate(lambda: running["n"])
    gate.set_quota(16, refill_s=0.2, env_quotas={"toy": 12, "residue": 4})
    gate.open()
    # toy asks first and keeps asking (atroposlib's pacing: its share and a group more); it may not take
    # residue's place in this version's batch.
    for _ in range(3):
        assert await gate.wait(4, "toy") == 0.0
    toy_extra = asyncio.create_task(gate.wait(4, "toy"))
    await asyncio.sleep(0.05)
    assert not toy_extra.done()
    assert await gate.wait(4, "residue") == 0.0  # residue's share is still there
    residue_extra = asyncio.create_task(gate.wait(4, "residue"))
    unnamed = asyncio.create_task(gate.wait(4))  # a request naming no environment: the batch's 16 are started
    await asyncio.sleep(0.05)
    assert not residue_extra.done() and not unnamed.done() and gate.holding == 3
    # The next version: each extra group starts on it, against its own environment's share.
    gate.close(2, hold_s=30)
    gate.open()
    assert await toy_extra > 0 and await residue_extra > 0 and await unnamed > 0
    assert await gate.wait(8, "toy") == 0.0  # 4 + 8 of toy's 12
    late_residue = asyncio.create_task(gate.wait(4, "residue"))  # 4 of 4 already started
    await asyncio.sleep(0.05)
    assert not late_residue.done()
    # Short of its share (a discarded group): the timed refill leaves named environments to the trainer, which
    # reads run-api's queue and names the one that is short; none of that environment's requests may have run
    # for refill_s then (between two turns of an episode it is busy, not short).
    gate.request_done()
    await asyncio.sleep(0.35)
    assert not late_residue.done() and gate.refills_total == 0
    gate.request_started("residue")
    assert gate.refill_envs({"residue": 4}) == []  # running
    gate.request_done("residue")
    assert gate.refill_envs({"residue": 4}) == []  # just ended: its next turn may be coming
    gate.request_started("toy")  # another environment's requests do not hold residue's refill back
    await asyncio.sleep(0.25)
    assert gate.refill_envs({"toy": 8, "nobody": 8}) == []  # toy holds nothing over its quota
    assert gate.refill_envs({"residue": 4}) == ["residue"]
    gate.request_done("toy")
    assert await late_residue > 0 and gate.refills_total == 1
    # A quota without environments, or env_quotas without a quota, is the batch's alone.
    gate.set_quota(None, refill_s=0.2, env_quotas={"toy": 4})
    gate.open()
    assert gate.env_quotas == {} and await gate.wait(64, "toy") == 0.0


async def test_what_a_refill_started_beyond_the_quota_comes_off_the_next_version():
    """Beyond its share, a refilled group is queued past the batch: run-api hands it out first with the next
    version's batch (stale there at max_staleness 0) in place of a fresh group, which is then left over in its
    turn. The next version starts that much less, which ends the chain after one batch."""
    gate = Gate()
    gate.set_quota(16, refill_s=0.1, env_quotas={"toy": 12, "residue": 4})
    gate.open()
    for env, n in (("toy", 4), ("toy", 4), ("toy", 4), ("residue", 4)):
        assert await gate.wait(n, env) == 0.0
    extra = [asyncio.create_task(gate.wait(4, env)) for env in ("toy", "toy", "residue")]
    await asyncio.sleep(0.05)
    assert gate.refill_envs({"toy": 4, "residue": 4}) == ["toy", "residue"]  # the whole groups each lacks
    await asyncio.sleep(0.05)
    assert sum(t.done() for t in extra) == 2 and gate.started_by_env() == {"toy": 16, "residue": 8, "": 0}
    # The trainer read run-api's queue just before a slow scorer's groups arrived: it asks again, and toy's other
    # held group starts beyond the share too.
    assert gate.refill_envs({"toy": 4}) == ["toy"]
    await asyncio.sleep(0.05)
    assert all(t.done() for t in extra) and gate.started_by_env() == {"toy": 20, "residue": 8, "": 0}
    gate.close(2, hold_s=30)
    gate.open()
    assert gate.carried_total == 12
    assert await gate.wait(4, "toy") == 0.0  # toy may start 12 - 8 = 4 on this version
    toy_next = asyncio.create_task(gate.wait(4, "toy"))
    residue_next = asyncio.create_task(gate.wait(4, "residue"))  # residue's 4 came off: none on this version
    await asyncio.sleep(0.05)
    assert not toy_next.done() and not residue_next.done()
    gate.close(3, hold_s=30)
    gate.open()  # that version started no more than its quota: the next has its whole share again
    assert await toy_next > 0 and await residue_next > 0
    assert gate.started_by_env() == {"toy": 4, "residue": 4, "": 0} and gate.carried_total == 12


async def test_a_lead_lets_the_first_version_start_the_next_batch_too_and_then_one_batch_per_version():
    """Without the gate (a mixed run at max_staleness 1): environments sample the next batch while the trainer
    trains on this one. Under one share per version from the start they never could: each batch would wait for
    the trainer's publish. The first version opened under the quotas allows two shares; every later version one,
    which the trainer takes a version later (lag 1)."""
    gate = Gate()
    assert gate.set_quota(16, refill_s=30, env_quotas={"a": 12, "b": 4}, lead=1)
    gate.open()
    for env, n in (("a", 12), ("b", 4), ("a", 12), ("b", 4)):
        assert await gate.wait(n, env) == 0.0
    third = asyncio.create_task(gate.wait(4, "a"))
    await asyncio.sleep(0.05)
    assert not third.done()
    assert not gate.set_quota(16, refill_s=30, env_quotas={"a": 12, "b": 4}, lead=1)  # re-sent: no new lead
    gate.open()  # a publish: one share each, nothing carried (two shares were granted)
    assert await third > 0 and gate.carried_total == 0
    assert await gate.wait(8, "a") == 0.0 and await gate.wait(4, "b") == 0.0
    over = asyncio.create_task(gate.wait(4, "b"))
    await asyncio.sleep(0.05)
    assert not over.done()
    gate.open()
    assert await over > 0


async def test_a_request_held_by_the_closed_gate_and_then_by_the_quota_is_refilled():
    """A CI run hung at step 8 (max_staleness 0, one environment): a refill had let the next batch start on the
    version, the carry left the next version no quota, and the requests the closed gate held stayed held by that
    quota uncounted, so no refill came. Counted from the opening on, the refill lets them through."""
    gate = Gate()
    gate.set_quota(8, refill_s=0.1)
    gate.open()
    assert await gate.wait(8) == 0.0
    early = asyncio.create_task(gate.wait(8))  # the next batch, started early: over the quota
    await asyncio.sleep(0.3)  # nothing runs: the refill lets it through on this version (16 of 8)
    assert early.done() and gate.refills_total == 1
    gate.close(2, hold_s=30)
    held = asyncio.create_task(gate.wait(8))  # held by the closed gate
    await asyncio.sleep(0.05)
    gate.open()  # the carry of 8 leaves this version no quota: held now by the quota
    await asyncio.sleep(0.05)
    assert not held.done() and gate.carried_total == 8
    await asyncio.sleep(0.3)
    assert held.done() and gate.refills_total == 2


async def test_the_gateway_tells_environments_apart_by_their_bearer_key(tmp_path):
    client, _ = client_for(ScriptedBackend())
    quotas = {"version": 0, "quota": 4, "refill_s": 0.3, "env_quotas": {"a": 2, "b": 2}}
    body = {"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 4, "n": 2}

    def key(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer rl-env:{name}"}

    async with client:
        assert (await client.post("/policy/expect", json=quotas)).status_code == 200
        assert (await client.post("/generate", json=body, headers=key("a"))).status_code == 200
        a_extra = asyncio.create_task(client.post("/generate", json=body, headers=key("a")))
        await asyncio.sleep(0.2)
        assert not a_extra.done()  # a's 2 are started; b's 2 are b's
        b = await client.post("/generate", json=body, headers=key("b"))
        assert b.status_code == 200 and b.headers["x-policy-version"] == "0"
        other = asyncio.create_task(
            client.post("/generate", json=body, headers={"Authorization": "Bearer local"})
        )
        await asyncio.sleep(0.2)
        assert not other.done()  # names no environment: the batch's 4 are started
        await client.post("/policy/expect", json={**quotas, "version": 1})
        await client.post("/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")))
        assert (await a_extra).headers["x-policy-version"] == "1" and (await other).status_code == 200


async def test_without_the_gate_each_publish_opens_a_fresh_share_and_resent_quotas_reset_nothing(tmp_path):
    """A mixed run at max_staleness 1 (no gate): the trainer sets the quotas once (again after a gateway restart);
    every publish starts the new version's shares, and so does a step that took a batch and made no update. Sending
    the same quotas again must not hand a version a second share: that extra group would be trained two versions
    old."""
    client, _ = client_for(ScriptedBackend())
    quotas = {"version": 0, "quota": 4, "refill_s": 30, "env_quotas": {"a": 2, "b": 2}, "hold_s": 60}
    body = {"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 4, "n": 2}
    a = {"Authorization": "Bearer rl-env:a"}
    async with client:
        assert (await client.post("/policy/expect", json=quotas)).json()["holding_for"] is None
        assert (await client.post("/generate", json=body, headers=a)).headers["x-policy-version"] == "0"
        assert (await client.post("/policy/expect", json=quotas)).json()["holding_for"] is None
        extra = asyncio.create_task(client.post("/generate", json=body, headers=a))
        await asyncio.sleep(0.2)
        assert not extra.done()  # still a's share of version 0 spent
        await client.post("/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")))
        assert (await asyncio.wait_for(extra, 10)).headers[
            "x-policy-version"
        ] == "1"  # the publish, not hold_s
        again = asyncio.create_task(client.post("/generate", json=body, headers=a))
        await asyncio.sleep(0.2)
        assert not again.done()  # version 1's share went to the held request
        no_update = {
            **quotas,
            "version": 1,
            "batch_taken": True,
        }  # a step took version 1's batch, made no update
        assert (await client.post("/policy/expect", json=no_update)).json()["holding_for"] is None
        assert (await asyncio.wait_for(again, 10)).headers["x-policy-version"] == "1"
        again = asyncio.create_task(client.post("/generate", json=body, headers=a))
        await asyncio.sleep(0.2)
        assert not again.done()
        changed = {**quotas, "version": 1, "quota": 6, "env_quotas": {"a": 4, "b": 2}}
        assert (await client.post("/policy/expect", json=changed)).json()["holding_for"] is None
        assert (await asyncio.wait_for(again, 10)).headers[
            "x-policy-version"
        ] == "1"  # new quotas start afresh on the current version


async def test_the_trainer_refills_a_short_environment_through_the_gateway():
    client, _ = client_for(ScriptedBackend(), publish_token="s3cret")
    owner = {"Authorization": "Bearer s3cret"}
    quotas = {"version": 0, "quota": 4, "refill_s": 0.3, "env_quotas": {"a": 2, "b": 2}}
    body = {"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 4, "n": 2}
    async with client:
        assert (await client.post("/policy/expect", json=quotas, headers=owner)).status_code == 200
        assert (
            await client.post("/generate", json=body, headers={"Authorization": "Bearer rl-env:a"})
        ).is_success
        held = asyncio.create_task(
            client.post("/generate", json=body, headers={"Authorization": "Bearer rl-env:a"})
        )
        await asyncio.sleep(0.4)  # a's first request ended refill_s ago: a is quiet, not between two turns
        assert (await client.post("/policy/refill", json={"short": {"a": 2}})).status_code == 401
        for bad in ({}, {"short": {}}, {"short": {"a": -1}}, {"short": {"a": 2}, "x": 1}, {"short": [2]}):
            r = await client.post("/policy/refill", json=bad, headers=owner)
            assert r.status_code == 400, (bad, r.text)
        assert not held.done()
        r = await client.post("/policy/refill", json={"short": {"a": 2, "b": 2}}, headers=owner)
        assert r.json() == {"refilled": ["a"]}  # b holds nothing over its quota
        assert (await held).headers["x-policy-version"] == "0"


@pytest.mark.parametrize(
    "env_quotas",
    [
        {"a": 0},
        {"a": -4},
        {"a": 2.5},
        {"a": "4"},
        {"": 4},
        {"a\nb": 4},
        {f"e{i}": 1 for i in range(300)},
        [4],
    ],
)
async def test_expect_refuses_bad_env_quotas(env_quotas):
    client, _ = client_for(ScriptedBackend())
    async with client:
        r = await client.post("/policy/expect", json={"version": 0, "quota": 4, "env_quotas": env_quotas})
    assert r.status_code == 400 and "env_quotas" in r.json()["error"]["message"], r.text


class FlakyGateway:
    """A gateway client whose publishes are refused by verification `refusals` times, then accepted."""

    def __init__(self, refusals: int):
        self.refusals = refusals
        self.published: list[tuple[int, str | None, Any]] = []

    def publish(self, version, adapter_path, replace_newer=False, probe=None):
        from trainer.training.gateway_client import PublishResponse

        self.published.append((version, adapter_path, probe))
        if self.refusals:
            self.refusals -= 1
            body = {
                "error": {
                    "message": "publish verification failed",
                    "type": "verification_failed",
                    "code": 422,
                    "max_abs_diff": 0.7,
                }
            }
            request = httpx.Request("POST", "http://gw/policy/publish")
            response = httpx.Response(422, json=body, request=request)
            raise httpx.HTTPStatusError("422", request=request, response=response)
        return PublishResponse(
            version=version,
            lora_name=f"policy-v{version}",
            load_s=0.01,
            unloaded=[],
            verify_max_abs_diff=1e-6,
            verify_s=0.01,
        )


class ProbingBackend:
    vocab_size = 2048

    def __init__(self, root):
        self.root, self.saves = root, 0

    def save_for_sampler(self, version: int) -> str:
        self.saves += 1
        folder = self.root / f"v{version:06d}"
        folder.mkdir()  # never overwritten: a retry must have removed the refused folder first
        return str(folder)

    def probe(self, prompts, top_k):
        return [{1: -0.1, 2: -2.5} for _ in prompts]


@pytest.mark.parametrize("retries", [0, 2])
def test_a_refused_publish_is_written_again_and_retried_then_stops_the_run(tmp_path, retries):
    from tests.helpers import make_cfg
    from trainer.training.publishing import Publisher, PublishUnverified

    cfg = make_cfg(tmp_path, publish__verify_retries=retries)
    backend = ProbingBackend(tmp_path)
    gateway = FlakyGateway(refusals=retries)  # refused `retries` times: the last retry passes
    outcome = Publisher(cfg, backend, gateway, overlap=False).start(1).result()  # type: ignore[arg-type]
    assert outcome.failures == retries and backend.saves == retries + 1
    assert outcome.worst_refused_diff == (0.7 if retries else None)
    # vLLM's dtype is not stated in this config: 'auto' beside a float32 CPU trainer is float32, so the largest
    # difference is held to the float32 tolerance.
    assert all(
        p is not None and len(p.prompts) == 4 and p.tolerance == FLOAT32_TOLERANCE and p.statistic == "max"
        for _, _, p in gateway.published
    )
    # One refusal more than the retries: the run stops (exit code 3 in trainer/__main__.py), with the numbers.
    gateway, backend = FlakyGateway(refusals=retries + 1), ProbingBackend(tmp_path / "again")
    (tmp_path / "again").mkdir()
    with pytest.raises(PublishUnverified, match=r"verification failed.*refused"):
        Publisher(cfg, backend, gateway, overlap=True).start(1).result()  # type: ignore[arg-type]


class LogitsBackend(ProbingBackend):
    """A backend whose probe gives raw logits, as LocalBackend's: a sharpened policy (top logit 17 on every
    prompt) and a base near uniform."""

    def probe_logits(self, prompts, adapter=True):
        logits_PV = torch.zeros(len(prompts), self.vocab_size)
        if adapter:
            logits_PV[:, 5], logits_PV[:, 6] = 17.0, 15.0
        return logits_PV


@pytest.mark.parametrize(
    ("over", "spacing"),
    [
        ({"model__dtype": "bfloat16", "trainer__save_dtype": "bfloat16"}, 0.125),
        (
            {"model__dtype": "float32", "inference__vllm": {"dtype": "float16"}},
            2**-6,
        ),  # vLLM's is the coarser
        ({"model__dtype": "float32"}, None),
    ],
)
def test_the_probe_carries_the_spacing_of_its_largest_logits_in_the_coarser_dtype(tmp_path, over, spacing):
    """In bf16 a logit of 17 sits among values 0.125 apart (16 x 2**-7): the probe says so, and the gateway adds
    it to the mean statistic's tolerance. Float32 end to end uses the max statistic, which needs no spacing."""
    from tests.helpers import make_cfg
    from trainer.training.publishing import Publisher, logit_spacing

    cfg = make_cfg(tmp_path, **over)
    publisher = Publisher(cfg, LogitsBackend(tmp_path), FlakyGateway(refusals=0), overlap=False)  # type: ignore[arg-type]
    probe, _ = publisher.probe()
    assert probe is not None and probe.logit_spacing == spacing
    assert probe.adapter_effect is not None and probe.adapter_effect > 1
    publisher.close()
    # The largest |logit| among each prompt's expected top-k, not the whole vocabulary's: -40 is not a candidate.
    logits_PV = torch.tensor([[17.0, 3.0, -40.0], [0.5, 0.2, 0.1]])
    top = [{0: -0.1, 1: -14.0}, {0: -1.0, 1: -1.2}]
    assert logit_spacing(logits_PV, top, 2**-7) == pytest.approx((0.125 + 2**-8) / 2)


class UnansweringGateway:
    """A gateway that is stopping: a publish is never answered."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def publish(self, version, adapter_path, replace_newer=False, probe=None):
        self.release.wait(60)
        raise httpx.ConnectError("the gateway went away")


def test_a_stop_does_not_wait_for_a_publish_the_stopping_gateway_never_answers(tmp_path, monkeypatch):
    """SIGTERM reaches the trainer and the gateway at once: the checkpoint must not wait on the publish in
    flight. The trainer's weights are the new version's all the same, so the checkpoint records that version (the
    resume publishes it again), and the stuck worker cannot hold the process open after it."""
    from tests.helpers import make_cfg
    from trainer.training import loop
    from trainer.training.publishing import Publisher

    monkeypatch.setattr(loop, "STOP_PUBLISH_WAIT_S", 0.3)
    gateway = UnansweringGateway()
    publisher = Publisher(make_cfg(tmp_path), ProbingBackend(tmp_path), gateway, overlap=True)  # type: ignore[arg-type]
    pending = loop.StepAwaitingPublish({}, loop.StepTimes(0.0), publisher.start(7), 7)
    worker = next(t for t in threading.enumerate() if t.name == "publish-v7")
    assert worker.daemon  # a non-daemon thread would be joined at exit, after the launcher's SIGKILL
    started = time.monotonic()
    assert loop._join_publish(pending, stopping=True) == (7, None)
    assert time.monotonic() - started < 5
    gateway.release.set()  # the gateway's connection drops: the same answer, and no wait at all
    pending = loop.StepAwaitingPublish({}, loop.StepTimes(0.0), publisher.start(8), 8)
    assert loop._join_publish(pending, stopping=True) == (8, None)
    with pytest.raises(httpx.ConnectError):  # not stopping: a failed publish is the run's error, as before
        loop._join_publish(
            loop.StepAwaitingPublish({}, loop.StepTimes(0.0), publisher.start(9), 9), stopping=False
        )
    assert loop._join_publish(loop.StepAwaitingPublish({}, loop.StepTimes(0.0), None), stopping=True) == (
        None,
        None,
    )
    publisher.close()


@pytest.mark.parametrize(
    ("config", "device", "expected"),
    [
        ("tiny_cpu.yaml", "cpu", (1e-3, "max")),
        ("tiny_cpu.yaml", "cuda", (0.02, "mean")),  # the tiny recipe runs in bf16 on CUDA
        ("gsm8k.yaml", "cuda", (0.02, "mean")),
        ("gsm8k.yaml", "cpu", (0.02, "mean")),
    ],
)
def test_the_verification_statistic_follows_the_dtypes(config, device, expected):
    from trainer.training.config import RunConfig, load_config
    from trainer.training.publishing import verify_tolerance

    cfg = load_config(RunConfig, Path(__file__).resolve().parents[2] / "configs" / config)
    assert verify_tolerance(cfg, device) == expected
    cfg.publish.verify_tolerance = 0.05
    assert verify_tolerance(cfg, device) == (0.05, expected[1])


@pytest.mark.parametrize(("given", "gate"), [("on", "on"), ("off", "off"), ("auto", "auto"), ("'on'", "on")])
def test_publish_gate_takes_bare_on_and_off(given, gate):
    from trainer.training.config import RunConfig, load_config

    assert load_config(RunConfig, None, [f"publish.gate={given}"]).publish.gate == gate


class NoisyBackend(ScriptedBackend):
    """A bf16-like vLLM: version v's answer to prompt p is logprob -0.5 * (1 + v) for ids 1..8, each moved by a
    fixed +-noise (the same per id on every version, the base included), so the mean |diff| is `noise` exactly."""

    def __init__(self, noise: float):
        super().__init__()
        self.noise = noise
        self.probed: list[str] = []
        self.answer_as: dict[int, int] = {}  # version -> the version whose weights vLLM actually answers with
        self.adapter_offset = 0.0  # added to every answer of an adapter (not the base's)

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        self.probed.append(policy.model_name)
        version = self.answer_as.get(policy.version, policy.version)
        offset = self.adapter_offset if policy.version else 0.0
        top = {f"token_id:{t}": answer(version, t) + self.noise * (-1) ** t + offset for t in range(1, 9)}
        choice = {"logprobs": {"top_logprobs": [top]}, "token_ids": [1]}
        return {"choices": [{"index": i, **choice} for i in range(len(body["prompt"]))]}


def answer(version: int, token: int) -> float:
    return -0.5 * (1 + version) - 0.01 * token


def mean_probe(version: int, **references: int) -> dict:
    def tops(v: int) -> list[dict[str, float]]:
        return [{str(t): answer(v, t) for t in range(1, 9)}] * 2

    return {
        "prompts": [[3, 4], [5, 6]],
        "top_logprobs": tops(version),
        "tolerance": LOW_PRECISION_TOLERANCE,
        "statistic": "mean",
        "references": {name: tops(v) for name, v in references.items()},
        "adapter_effect": 0.5 * version,
    }


async def test_the_mean_statistic_is_calibrated_on_the_base_and_passes_bf16_noise(tmp_path):
    """Noise of 0.1 on every logprob (past any fixed max tolerance) passes once the base shows the same noise;
    the tolerance is 4x the base's noise plus 3% of the adapter's effect."""
    backend = NoisyBackend(noise=0.1)
    client, reg = client_for(backend)
    async with client:
        body = publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": mean_probe(1, base=0)}
        r = await client.post("/policy/publish", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["verify_noise"] == pytest.approx(0.1) and reply["verify_mean_abs_diff"] == pytest.approx(
            0.1
        )
        assert reply["verify_tolerance"] == pytest.approx(4 * 0.1 + 0.03 * 0.5)
        assert reply["verify_separation"] == pytest.approx(0.5 / reply["verify_tolerance"])
        assert reply["verify_margin"] == pytest.approx(1 - 0.1 / reply["verify_tolerance"])
        assert backend.probed == [
            reg.base.model_name,
            "policy-v1",
        ]  # the base first, before the adapter loads
        # Every publish measures the base again: the noise is tracked, not fixed at the first publish.
        body = publish_body(2, make_adapter(tmp_path, "a2")) | {"probe": mean_probe(2, base=0, previous=1)}
        assert (await client.post("/policy/publish", json=body)).status_code == 200
        assert backend.probed == [reg.base.model_name, "policy-v1", reg.base.model_name, "policy-v2"]


async def test_the_noise_is_measured_again_after_a_vllm_restart(tmp_path):
    """A quiet first vLLM process, then a restarted one whose numerics are noisier: its publish is held to its own
    noise (the old window is dropped), and a quiet measurement later does not hide the noise the median holds."""
    backend = NoisyBackend(noise=0.001)
    client, _ = client_for(backend)
    async with client:
        for v in (1, 2, 3):
            body = publish_body(v, make_adapter(tmp_path, f"a{v}")) | {"probe": mean_probe(v, base=0)}
            assert (await client.post("/policy/publish", json=body)).json()["verify_noise"] == pytest.approx(
                0.001
            )
        backend.restarts, backend.noise = (
            1,
            0.1,
        )  # the gateway restarted vLLM; 0.1 fails any uncalibrated check
        noises = []
        for v, noise in ((4, 0.1), (5, 0.1), (6, 0.08)):
            backend.noise = noise
            body = publish_body(v, make_adapter(tmp_path, f"a{v}")) | {"probe": mean_probe(v, base=0)}
            r = await client.post("/policy/publish", json=body)
            assert r.status_code == 200, r.text
            noises.append(r.json()["verify_noise"])
        assert noises == pytest.approx([0.1, 0.1, 0.1])  # the window's median (0.1), not the newest (0.08)


def test_the_noise_floor_is_the_larger_of_the_rolling_median_and_the_newest():
    from inference.policy.probe_check import NOISE_WINDOW, NoiseFloor

    floor = NoiseFloor()
    assert [floor.add(x, 0) for x in (0.01, 0.03, 0.02, 0.001)] == [0.01, 0.03, 0.02, 0.015]
    assert floor.add(0.5, 0) == 0.5  # a noisy moment counts at once: the adapter is checked in that moment
    for _ in range(NOISE_WINDOW):
        floor.add(0.002, 0)
    assert floor.add(0.002, 0) == 0.002  # the old measurements left the window
    assert floor.add(0.2, 1) == 0.2 and floor.window == [0.2]  # another vLLM process: a window of its own


async def test_the_mean_statistic_allows_the_spacing_of_the_probe_s_largest_logits(tmp_path):
    """A sharpened policy's logits sit where bf16 values are 0.125 apart: a difference of 0.1 on the adapter's
    logprobs, which the base model (small logits, quiet) never shows, is refused without that spacing and passes
    once the trainer sends it."""
    backend = NoisyBackend(noise=0.001)
    backend.adapter_offset = 0.1
    client, reg = client_for(backend)
    async with client:
        body = publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": mean_probe(1, base=0)}
        r = await client.post("/policy/publish", json=body)
        assert r.status_code == 422 and r.json()["error"]["tolerance"] == pytest.approx(0.02), r.text
        body["probe"]["logit_spacing"] = 0.125
        r = await client.post("/policy/publish", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["verify_tolerance"] == pytest.approx(4 * 0.001 + 0.03 * 0.5 + 0.125)
        assert r.json()["verify_mean_abs_diff"] == pytest.approx(0.1) and reg.current.version == 1


@pytest.mark.parametrize("served_as", ["previous", "base", "other"])
async def test_the_mean_statistic_still_refuses_a_wrong_adapter(tmp_path, served_as):
    """Under bf16-sized noise, the adapter served is the previous version's, no adapter at all, or another one:
    refused, and nothing stays loaded under the refused version."""
    backend = NoisyBackend(noise=0.05)
    client, reg = client_for(backend)
    async with client:
        body = publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": mean_probe(1, base=0)}
        assert (await client.post("/policy/publish", json=body)).status_code == 200
        backend.answer_as[2] = {"previous": 1, "base": 0, "other": 7}[served_as]
        body = publish_body(2, make_adapter(tmp_path, "a2")) | {"probe": mean_probe(2, base=0, previous=1)}
        r = await client.post("/policy/publish", json=body)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "verification_failed" and err["mean_abs_diff"] > err["tolerance"]
        assert err["noise"] == pytest.approx(0.05)
        if served_as != "other":  # served another known candidate: the message names it
            assert f"nearer the {served_as}'s" in err["message"]
        assert reg.current.version == 1 and backend.unloaded[-1] == "policy-v2"


def test_a_refusal_names_what_vllm_served_or_its_numerics():
    from inference.policy.probe_check import ProbeCheck, refusal_cause

    check = ProbeCheck(0.9, 0.5, 16, 0.2, "mean")
    assert refusal_cause(check, 0.01, {"base": 0.05, "previous": 0.3}).startswith(
        "the adapter: vLLM's answer is nearer the base's (0.05)"
    )
    assert refusal_cause(check, 0.01, {"previous": 0.6}).startswith("the adapter: vLLM's answer is none")
    near_edge = ProbeCheck(0.5, 0.3, 16, 0.2, "mean")
    assert refusal_cause(near_edge, 0.04, {"previous": 0.6}) == (
        "probably vLLM's numerics: within twice the tolerance and nearer nothing else; its base model alone "
        "differs by 0.04"
    )


async def test_a_base_model_that_is_not_the_trainers_refuses_every_publish(tmp_path):
    backend = NoisyBackend(noise=0.0)
    client, reg = client_for(backend)
    async with client:
        probe = mean_probe(1, base=0)
        probe["references"]["base"] = [{"100": -0.1, "101": -0.2}] * 2  # another model's top tokens
        r = await client.post(
            "/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": probe}
        )
        assert r.status_code == 422 and "base model" in r.json()["error"]["message"]
        assert reg.current.version == 0 and "policy-v1" not in backend.loaded


async def test_probe_references_must_align_with_the_prompts(tmp_path):
    client, _ = client_for(NoisyBackend(noise=0.0))
    async with client:
        probe = mean_probe(1, base=0)
        probe["references"]["base"] = probe["references"]["base"][:1]
        r = await client.post(
            "/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": probe}
        )
        assert r.status_code == 400 and "references.base" in r.text


class ProbeRefusingBackend(NoisyBackend):
    """vLLM refuses the probe request itself (e.g. a probe prompt past the context)."""

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        if policy.version > 0:
            from inference.errors import BackendError

            raise BackendError(400, "This model's maximum context length is 4 tokens")
        return await super().forward(path, body, policy)


async def test_a_refused_probe_unwinds_and_the_version_can_be_published_again(tmp_path):
    backend = ProbeRefusingBackend(noise=0.0)
    client, reg = client_for(backend)
    async with client:
        body = publish_body(1, make_adapter(tmp_path, "a1")) | {"probe": mean_probe(1, base=0)}
        assert (await client.post("/policy/publish", json=body)).status_code >= 400
        assert reg.current.version == 0 and backend.unloaded == ["policy-v1"]  # nothing left loaded under v1
        backend.__class__ = NoisyBackend  # vLLM takes the probe now: the same version publishes
        again = publish_body(1, make_adapter(tmp_path, "a1-again")) | {"probe": mean_probe(1, base=0)}
        r = await client.post("/policy/publish", json=again)
        assert r.status_code == 200, r.text
        assert reg.current.version == 1


async def test_openapi_docs_are_off_unless_asked_for():
    client, _ = client_for(ScriptedBackend())
    async with client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await client.get(path)).status_code == 404, path
    client, _ = client_for(ScriptedBackend(), openapi_docs=True)
    async with client:
        assert (await client.get("/openapi.json")).status_code == 200
