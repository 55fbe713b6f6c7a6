"""A multi-turn episode stays on the version it started on: a request whose prompt ids continue a turn the gateway
sampled (the ledger's longest recorded prefix) passes the closed on-policy gate and its quota and is sampled on that
turn's version while it is loaded, on the current one once it is gone. Against a scripted sampler."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from inference.policy.gate import Gate
from inference.policy.registry import ABANDONED, Policy, PolicyRegistry, Recorded, VersionLedger
from tests.scripted_gateway import ScriptedBackend, client_for, make_adapter, publish_body


def generate(prompt: list[int], n: int = 1) -> dict[str, Any]:
    return {"prompt": {"prompt_token_ids": prompt}, "max_tokens": 4, "n": n}


class EchoBackend(ScriptedBackend):
    """/generate samples [version, i] (ScriptedBackend); the OpenAI routes sample [20 + version] after the prompt."""

    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
        if self.gate is not None:
            await self.gate.wait()
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], list) else [prompt]
        choices = [
            {
                "index": i,
                "text": "x",
                "token_ids": [20 + policy.version],
                "prompt_token_ids": list(one) if isinstance(one, list) else [1, 2],
            }
            for i, one in enumerate(prompts)
        ]
        return {"choices": choices, "model": policy.model_name}


async def status(client: Any) -> dict[str, Any]:
    return (await client.get("/policy")).json()


def test_the_ledger_finds_the_longest_recorded_prefix():
    led = VersionLedger(capacity=100)
    led.record([1, 2], [3], 1)
    led.record([1, 2, 3, 4], [5, 6], 2)
    assert led.continued([1, 2, 3, 4, 5, 6, 7]) == Recorded(6, 2, 0)
    assert led.continued([1, 2, 3, 4, 5, 6]) == Recorded(6, 2, 0)  # the whole prompt is a recorded sequence
    assert led.continued([1, 2, 3, 9, 9, 9, 9]) == Recorded(3, 1, 0)  # the later turn diverges: the first one
    assert led.continued([1, 2]) is None  # a recorded prompt alone is no sampled turn
    assert led.continued([2, 1, 3]) is None and led.continued([]) is None
    # An empty completion's key is its bare prompt: every later request with that prompt would match it.
    led.record([7, 8], [], 3)
    assert led.continued([7, 8, 1]) is None and led.lookup([7, 8]) == 3


def test_the_prefix_index_follows_eviction_and_rerecording():
    led = VersionLedger(capacity=2)
    led.record([1, 2], [3], 1)
    led.record([1], [2, 3], 2)  # the same sequence again: one entry, one length
    assert led.continued([1, 2, 3, 4]) == Recorded(3, 2, 0) and led._lengths == [3]
    led.record([5], [6, 7, 8], 3)
    led.record([9], [9], 4)  # evicts [1, 2, 3]: its length goes with it (no digest is spent on it)
    assert led.continued([1, 2, 3, 4]) is None and led._lengths == [2, 4]
    assert led.continued([5, 6, 7, 8, 0]) == Recorded(4, 3, 0)


def test_the_prefix_lookup_agrees_with_a_brute_force_search():
    rng = random.Random(7)
    led = VersionLedger(capacity=10_000)
    recorded: dict[tuple[int, ...], int] = {}
    for version in range(300):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        completion = [rng.randrange(3) for _ in range(rng.randrange(0, 4))]
        led.record(prompt, completion, version)
        if completion:
            recorded[tuple(prompt + completion)] = version
        else:
            recorded.pop(tuple(prompt), None)  # an empty completion re-recorded a key: no longer a candidate
    for _ in range(300):
        ids = [rng.randrange(3) for _ in range(rng.randrange(0, 16))]
        best = max((n for n in range(len(ids) + 1) if tuple(ids[:n]) in recorded), default=None)
        found = led.continued(ids)
        if best is None:
            assert found is None, ids
        else:
            assert found == Recorded(best, recorded[tuple(ids[:best])], 0), ids


def test_a_rollback_abandons_the_episodes_it_retracted():
    reg = PolicyRegistry("base", max_staleness=3)
    led = VersionLedger(capacity=100, timeline=reg.timeline)
    reg.publish(Policy(1, "policy-v1", "/a/1"))
    reg.publish(Policy(2, "policy-v2", "/a/2"))
    led.record([1], [10], 1)
    led.record([1, 10, 5], [11], 2)
    target, _ = reg.prepare(1, "/a/1")
    reg.make_current(target)  # back to 1: version 2 is abandoned
    assert led.continued([1, 10, 5, 11, 6]) == Recorded(4, ABANDONED, 0)
    assert led.continued([1, 10, 7]) == Recorded(2, 1, 0)
    assert reg.acquire(Recorded(4, ABANDONED, 0)) == reg.current


def test_an_episode_turn_gets_its_version_while_loaded_and_keeps_it_loaded():
    reg = PolicyRegistry("base", max_staleness=0)
    v1 = Policy(1, "policy-v1", "/a/1")
    reg.publish(v1)
    reg.publish(Policy(2, "policy-v2", "/a/2"))
    assert reg.removable() == [v1]
    held = reg.acquire(Recorded(3, 1, 0))
    assert held == v1 and reg.removable() == [] and reg.in_flight() == {1: 1}
    reg.release(held)
    reg.remove(v1)
    assert reg.acquire(Recorded(3, 1, 0)) == reg.current  # unloaded: the current version
    # Another policy at the episode's version number (a later generation) is not the episode's.
    assert reg.acquire(Recorded(3, 2, 1)) == reg.current and reg.current.generation == 0


async def test_a_continuation_passes_the_closed_gate_and_a_fresh_request_waits(tmp_path):
    client, _ = client_for(EchoBackend())
    async with client:
        first = await client.post("/generate", json=generate([1, 2]))
        assert first.json()["token_ids"] == [[0, 0]]  # [version, index]: the next turn starts [1, 2, 0, 0]
        await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        fresh = asyncio.create_task(client.post("/generate", json=generate([3, 4])))
        later = await asyncio.wait_for(client.post("/generate", json=generate([1, 2, 0, 0, 5])), 5)
        assert later.status_code == 200 and later.headers["x-policy-version"] == "0"
        # Its own turn is recorded: the episode's third turn continues the second.
        third = await asyncio.wait_for(client.post("/generate", json=generate([1, 2, 0, 0, 5, 0, 0, 6])), 5)
        assert third.headers["x-policy-version"] == "0"
        state = await status(client)
        assert not fresh.done() and state["gate_holding"] == 1
        assert state["gate_continuations_total"] == 2 and state["continuations_moved_total"] == 0
        await client.post("/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")))
        assert (await fresh).headers["x-policy-version"] == "1"


async def test_continuations_do_not_count_against_the_quota():
    client, _ = client_for(EchoBackend())
    async with client:
        await client.post("/policy/expect", json={"version": 0, "quota": 2, "refill_s": 30})
        assert (await client.post("/generate", json=generate([1, 2], n=2))).status_code == 200
        for i in range(2):  # both episodes of the group go on: the quota is full, they are not held
            turn = await asyncio.wait_for(client.post("/generate", json=generate([1, 2, 0, i, 7])), 5)
            assert turn.headers["x-policy-version"] == "0"
        early = asyncio.create_task(client.post("/generate", json=generate([3])))
        await asyncio.sleep(0.2)
        assert not early.done()  # a new episode still waits for the next version
        early.cancel()


async def test_a_turn_runs_on_its_episodes_version_while_loaded_then_on_the_current_one(tmp_path):
    backend = EchoBackend()
    client, reg = client_for(backend, keep_versions=0)
    async with client:
        await client.post("/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")))
        assert (await client.post("/generate", json=generate([1, 2]))).headers["x-policy-version"] == "1"
        backend.gate = asyncio.Event()
        running = asyncio.create_task(client.post("/generate", json=generate([9])))  # keeps v1 loaded
        await asyncio.sleep(0.05)
        await client.post("/policy/publish", json=publish_body(2, make_adapter(tmp_path, "a2")))
        later = asyncio.create_task(client.post("/generate", json=generate([1, 2, 1, 0, 5])))
        await asyncio.sleep(0.05)
        assert reg.in_flight() == {1: 2}
        backend.gate.set()
        assert (await later).headers["x-policy-version"] == "1"
        await running
        for _ in range(50):  # the last request on v1 is done: it is unloaded now
            await asyncio.sleep(0.01)
            if backend.unloaded:
                break
        assert backend.unloaded == ["policy-v1"]
        # The episode's version is gone: its next turn is sampled on the current one, and said so.
        gone = await client.post("/generate", json=generate([1, 2, 1, 0, 5, 1, 0, 6]))
        assert gone.headers["x-policy-version"] == "2"
        state = await status(client)
        assert state["gate_continuations_total"] == 2 and state["continuations_moved_total"] == 1


async def test_token_prompts_of_every_route_continue_and_messages_wait():
    client, _ = client_for(EchoBackend())
    async with client:
        await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1})
        await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        held = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
        text = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "hi"}))
        bodies = [
            ("/v1/completions", {"model": "m", "prompt": [1, 2, 20, 3], "max_tokens": 1}),
            ("/v1/completions", {"model": "m", "prompt": [[1, 2, 20, 4]], "max_tokens": 1}),
            (
                "/v1/chat/completions/tokens",
                {"messages": chat["messages"], "tokens": [1, 2, 20, 5], "max_tokens": 1},
            ),
        ]
        for path, body in bodies:
            r = await asyncio.wait_for(client.post(path, json=body), 5)
            assert r.status_code == 200 and r.headers["x-policy-version"] == "0", (path, r.text)
        # Several prompts in one body are not an episode's turn: they wait like any other request.
        two = {"model": "m", "prompt": [[1, 2, 20, 6], [1, 2, 20, 7]], "max_tokens": 1}
        batch = asyncio.create_task(client.post("/v1/completions", json=two))
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in (held, text, batch))
        assert (await status(client))["gate_continuations_total"] == 3
        await client.post("/policy/expect", json={"version": 0})  # nothing is coming: opens
        assert [(await t).status_code for t in (held, text, batch)] == [200, 200, 200]


async def test_a_long_prompt_is_matched_off_the_event_loop_all_the_same(monkeypatch):
    monkeypatch.setattr("inference.app.INLINE_CONTINUATION_IDS", 2)  # every prompt here is "long"
    client, _ = client_for(EchoBackend())
    async with client:
        await client.post("/generate", json=generate([1, 2]))
        await client.post("/policy/expect", json={"version": 1, "hold_s": 30})
        later = await asyncio.wait_for(client.post("/generate", json=generate([1, 2, 0, 0, 5])), 5)
        assert later.status_code == 200 and (await status(client))["gate_continuations_total"] == 1


async def test_a_spell_counts_the_continuations_it_let_through():
    gate = Gate()
    gate.admit_continuation()  # open: counted in the total only
    gate.close(1, hold_s=30)
    gate.admit_continuation()
    gate.admit_continuation()
    spell = gate.open()
    assert spell is not None and spell.continuations == 2 and spell.held_requests == 0
    assert gate.continuations_total == 3
    gate.close(2, hold_s=30)
    spell = gate.open()
    assert spell is not None and spell.continuations == 0


class SlowUnloadBackend(EchoBackend):
    def __init__(self) -> None:
        super().__init__()
        self.unload_gate: asyncio.Event | None = None

    async def unload_adapter(self, policy: Policy) -> None:
        if self.unload_gate is not None:
            await self.unload_gate.wait()
        await super().unload_adapter(policy)


async def test_a_version_an_episode_takes_during_a_cleanup_is_not_unloaded_under_it(tmp_path):
    backend = SlowUnloadBackend()
    client, reg = client_for(backend, keep_versions=0)
    async with client:
        await client.post("/policy/publish", json=publish_body(1, make_adapter(tmp_path, "a1")))
        held = [reg.acquire()]
        await client.post("/policy/publish", json=publish_body(2, make_adapter(tmp_path, "a2")))
        await client.post("/generate", json=generate([3, 4]))  # the episode's first turn, on 2
        held.append(reg.acquire())
        await client.post("/policy/publish", json=publish_body(3, make_adapter(tmp_path, "a3")))
        assert backend.unloaded == [] and [p.version for p in reg.loaded()] == [0, 1, 2, 3]
        backend.unload_gate = asyncio.Event()
        for policy in held:
            reg.release(policy)
        await client.post("/generate", json=generate([7]))  # its end starts a cleanup of 1 and 2: 1 first
        await asyncio.sleep(0.05)
        backend.gate = asyncio.Event()
        later = asyncio.create_task(client.post("/generate", json=generate([3, 4, 2, 0, 5])))
        await asyncio.sleep(0.05)
        assert reg.in_flight() == {2: 1}
        backend.unload_gate.set()  # the cleanup goes on to 2, which the episode's turn holds now
        await asyncio.sleep(0.05)
        assert backend.unloaded == ["policy-v1"]
        backend.gate.set()
        assert (await later).headers["x-policy-version"] == "2"
        for _ in range(50):
            await asyncio.sleep(0.01)
            if len(backend.unloaded) == 2:
                break
        assert backend.unloaded == ["policy-v1", "policy-v2"]


async def test_a_chat_group_asked_for_one_rollout_at_a_time_is_admitted_whole():
    """verifiers' way: group_size requests of n = 1 with the same messages. The first reserves the group; the rest
    pass, and another prompt waits for the next version once the quota is reserved."""
    client, _ = client_for(EchoBackend())
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    other = {**chat, "messages": [{"role": "user", "content": "bye"}]}
    async with client:
        quota = {"version": 0, "quota": 4, "group_size": 4, "refill_s": 30}
        assert (await client.post("/policy/expect", json=quota)).status_code == 200
        first = [asyncio.create_task(client.post("/v1/chat/completions", json=chat)) for _ in range(2)]
        later = asyncio.create_task(client.post("/v1/chat/completions", json=other))
        first += [asyncio.create_task(client.post("/v1/chat/completions", json=chat)) for _ in range(2)]
        assert [(await asyncio.wait_for(t, 5)).status_code for t in first] == [200] * 4
        await asyncio.sleep(0.1)
        assert not later.done()
        assert (await status(client))["gate_group_passes_total"] == 3
        await client.post(
            "/policy/expect", json={"version": 0, "quota": 4, "group_size": 4, "batch_taken": True}
        )
        assert (await asyncio.wait_for(later, 5)).status_code == 200
