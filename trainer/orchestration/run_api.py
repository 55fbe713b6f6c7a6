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

Served by uvicorn as `trainer.orchestration.run_api:app`; imports only atroposlib and FastAPI.
"""

from __future__ import annotations

from typing import Any

from atroposlib.api import server
from fastapi.routing import APIRoute

app = server.app


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


def _install() -> None:
    # Ours first: Starlette answers with the first route that matches, and atroposlib's /register-env exists.
    ours = [
        APIRoute("/register-env", register_env, methods=["POST"]),
        APIRoute("/envs", list_envs, methods=["GET"]),
        APIRoute("/status", status, methods=["GET"]),
    ]
    app.router.routes[:0] = ours


_install()
