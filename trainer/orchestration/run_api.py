"""A mixed run's run-api: atroposlib's own app, unchanged, plus what several environments in one run need.

- `GET /envs`: every registered environment (id, name, connected, weight, min_batch_allocation, group_size) and
  the sequences each has queued. Groups reach the trainer with only their run-api `env_id`; this maps it to the
  environment's name (its desired_name, `<name>-<worker>`), and tells the idle diagnosis who is not sending.
- `GET /status` also carries that list, so the launcher's idle diagnosis, which polls /status, can name the
  environment that holds the batch.
- `POST /register-env` first marks any connected registration under the same name disconnected. A name is one
  environment process (the launcher makes them unique), so a second registration means the first process died
  and was restarted. atroposlib keeps a dead registration "connected" (a killed process never calls
  /disconnect-env), and with min_batch_allocation a connected environment with nothing queued holds every batch:
  without this, one environment's crash would stall the whole run.

- `GET /batch` forms a batch only once every connected environment has its whole minimum share queued
  (atroposlib's own forms it once each has a group, and fills the rest in queue order). Then, when the trainer has
  waited `RUN_API_MIX_WAIT_S` seconds (the launcher passes rollout.mix_wait_s) for a batch that one environment's
  minimum share holds back (it sends too little: slow, stopped, restarting), it forms the batch without that
  environment's minimum: the others fill it, or, as each caps what it queues at its own share,
  what they have queued makes a short batch. What each environment fell short of its share is counted in
  `GET /envs` (`short_batches`, `shortfall_sequences`), which the trainer records per environment.

Served by uvicorn as `trainer.orchestration.run_api:app`; imports only atroposlib and FastAPI.
"""

from __future__ import annotations

import os
import time
from typing import Any

from atroposlib.api import server
from fastapi.routing import APIRoute

from trainer.training.rollout_config import MIX_WAIT_S_DEFAULT

app = server.app
MIX_WAIT_S = float(os.environ.get("RUN_API_MIX_WAIT_S", MIX_WAIT_S_DEFAULT))
waiting_since: float | None = None  # when the trainer's first unanswered /batch of the current batch came
shortfall: dict[int, list[int]] = {}  # env id -> [batches it fell short in, sequences short]


def registered(state: Any) -> list[dict[str, Any]]:
    return list(getattr(state, "envs", []))


def queued_by_env(state: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for group in getattr(state, "queue", []):
        env_id = group.get("env_id")
        if env_id is not None:
            out[env_id] = out.get(env_id, 0) + len(group.get("tokens", []))
    return out


async def list_envs() -> dict[str, Any]:
    queued = queued_by_env(app.state)
    return {
        "envs": [
            {
                "env_id": e["registered_id"],
                "name": e["desired_name"],
                "connected": e["connected"],
                "weight": e["weight"],
                "min_batch_allocation": e["min_batch_allocation"],
                "group_size": e["group_size"],
                "queued_sequences": queued.get(e["registered_id"], 0),
                "short_batches": shortfall.get(e["registered_id"], [0, 0])[0],
                "shortfall_sequences": shortfall.get(e["registered_id"], [0, 0])[1],
            }
            for e in registered(app.state)
        ]
    }


async def status() -> dict[str, Any]:
    """atroposlib's /status, plus each environment's queue (what the launcher's idle diagnosis names)."""
    answer: dict[str, Any] = await server.get_status()
    return {**answer, **(await list_envs())}


async def register_env(register_env: server.RegisterEnv) -> dict[str, Any]:
    if getattr(
        app.state, "started", False
    ):  # atroposlib refuses registrations until then; nothing to replace
        for e in registered(app.state):
            if e["desired_name"] == register_env.desired_name and e["connected"]:
                e["connected"] = False
                server.logger.warning(
                    "environment %s registered again: its earlier registration (id %s) is disconnected",
                    register_env.desired_name,
                    e["registered_id"],
                )
    result: dict[str, Any] = await server.register_env_url(register_env)
    return result


def needed(env: dict[str, Any], batch_size: int) -> int:
    """An environment's minimum sequences per batch, as atroposlib computes it."""
    return int(batch_size * env["min_batch_allocation"])


def short_of_minimum(state: Any) -> list[dict[str, Any]]:
    """The connected environments with fewer sequences queued than their minimum share of a batch; none when the
    minimums add up to more than a batch (atroposlib scales them down then)."""
    with_minimum = [
        e for e in registered(state) if e["connected"] and e.get("min_batch_allocation") is not None
    ]
    if sum(needed(e, state.batchsize) for e in with_minimum) > state.batchsize:
        return []
    queued = queued_by_env(state)
    return [e for e in with_minimum if queued.get(e["registered_id"], 0) < needed(e, state.batchsize)]


async def get_batch() -> dict[str, Any]:
    """atroposlib's /batch once every environment has its minimum share queued; past MIX_WAIT_S of waiting,
    without the minimum of each environment short of it. atroposlib alone forms a batch as soon as each environment
    has one group queued and fills the rest in queue order: another environment's extra group (one a refill started
    for a discarded group) then takes the place of a slow environment's second group, which is left over for the next
    batch, stale there at max_staleness 0, and so on at every step."""
    global waiting_since
    state, now = app.state, time.monotonic()
    relaxed: list[dict[str, Any]] = []
    if getattr(state, "started", False) and not state.curr_batch:
        waiting_since = waiting_since if waiting_since is not None else now
        lacking = short_of_minimum(state)
        if lacking and now - waiting_since <= MIX_WAIT_S:
            return {"batch": None}
        relaxed = lacking
    before = len(getattr(state, "curr_batch", []))
    saved = [e["min_batch_allocation"] for e in relaxed]
    for e in relaxed:
        e["min_batch_allocation"] = None
    try:
        answer: dict[str, Any] = await server.get_batch()
    finally:
        for e, value in zip(relaxed, saved, strict=True):
            e["min_batch_allocation"] = value
    if relaxed and not answer.get("batch"):
        answer = short_batch(state)
    if answer.get("batch"):
        waiting_since = None
        formed = [answer["batch"], *state.curr_batch[before:]]
        for e in relaxed:
            for batch in formed:
                got = sum(len(g["tokens"]) for g in batch if g.get("env_id") == e["registered_id"])
                short = max(0, needed(e, state.batchsize) - got)
                counts = shortfall.setdefault(e["registered_id"], [0, 0])
                counts[0] += 1
                counts[1] += short
            server.logger.warning(
                "environment %s held the batch for over %.0f s: %d batch(es) formed without its minimum share",
                e["desired_name"],
                MIX_WAIT_S,
                len(formed),
            )
    return answer


def short_batch(state: Any) -> dict[str, Any]:
    """A batch of what is queued, up to the batch size: each environment caps what it queues at its own share (its
    min_batch_allocation), so without one of them the others cannot fill a whole batch by themselves."""
    taken, total = [], 0
    for group in state.queue:
        n = len(group.get("tokens", []))
        if total + n <= state.batchsize:
            taken.append(group)
            total += n
    if not taken:
        return {"batch": None}
    ids = {id(g) for g in taken}
    state.queue = [g for g in state.queue if id(g) not in ids]
    state.status_dict["step"] += 1
    server.logger.warning("sending a short batch of %d sequences (batch size %d)", total, state.batchsize)
    return {"batch": taken}


def _install() -> None:
    # Ours first: Starlette answers with the first route that matches, and atroposlib's /register-env exists.
    ours = [
        APIRoute("/register-env", register_env, methods=["POST"]),
        APIRoute("/envs", list_envs, methods=["GET"]),
        APIRoute("/status", status, methods=["GET"]),
        APIRoute("/batch", get_batch, methods=["GET"]),
    ]
    app.router.routes[:0] = ours


_install()
