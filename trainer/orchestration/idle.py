"""Why is the run idle? When no training step has come for a while, the launcher prints one line naming the most
likely cause, read from what each component reports: the gateway's request and rejection counts, run-api's
queue (in a mixed run, each environment's), and the environments' own logs. Pure: the caller gathers the inputs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Lines of an environment's log that explain silence by themselves, and what to do about each.
ENV_LOG_HINTS: tuple[tuple[str, str], ...] = (
    (
        "Scores are the same in a group",
        "every group scored the same, and the environment skips such groups "
        "(ensure_scores_are_not_same); pass rollout.env_args.ensure_scores_are_not_same=false or check its reward",
    ),
    (
        "Token length is too long",
        "the environment drops groups with a sequence at its length limit; raise trainer.max_seq_len",
    ),
    ("Traceback", "the environment raised an exception"),
)
TAIL_BYTES = 64 * 1024


@dataclass
class Snapshot:
    """What the components said at one moment; None where one did not answer."""

    requests: int | None = None
    rejected: int | None = None
    rejected_by_reason: dict[str, int] | None = None
    last_rejection: str | None = None
    queued: int | None = None
    gate_waiting_for: int | None = None  # the version the on-policy gate holds requests for
    gate_holding: int = 0
    envs: list[dict[str, Any]] | None = None  # a mixed run's run-api: each registration and its queue

    @classmethod
    def read(cls, gateway: dict[str, Any] | None, run_api: dict[str, Any] | None) -> Snapshot:
        gateway = gateway or {}
        return cls(
            requests=gateway.get("requests_total"),
            rejected=gateway.get("rejected_total"),
            rejected_by_reason=gateway.get("rejected_by_reason"),
            last_rejection=gateway.get("last_rejection"),
            queued=(run_api or {}).get("queue_size"),
            gate_waiting_for=gateway.get("gate_waiting_for"),
            gate_holding=gateway.get("gate_holding") or 0,
            envs=(run_api or {}).get("envs"),
        )


def short_envs(envs: list[dict[str, Any]], batch_size: int) -> list[str]:
    """The connected environments of a mixed run with less than their share of a batch queued: run-api forms no
    batch until each has it (min_batch_allocation)."""
    out = []
    for e in envs:
        share = e.get("min_batch_allocation")
        if not e.get("connected") or share is None:
            continue
        wanted = int(batch_size * share)
        if e.get("queued_sequences", 0) < wanted:
            name = str(e.get("name", "?")).rsplit("-", 1)[0]
            out.append(
                f"{name} ({e.get('name')}: {e.get('queued_sequences', 0)} of its {wanted} sequences queued)"
            )
    return out


def log_tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def env_log_hint(tail: str) -> str | None:
    """The newest line of the tail that a known hint matches, with the hint."""
    lines = tail.splitlines()
    for line in reversed(lines):
        for needle, hint in ENV_LOG_HINTS:
            if needle in line:
                return f"{hint} (log: {line.strip()[:200]!r})"
    errors = [line for line in lines if re.search(r"\b(ERROR|CRITICAL)\b", line)]
    return f"its newest error: {errors[-1].strip()[:200]!r}" if errors else None


def delta(now: int | None, before: int | None) -> int | None:
    return None if now is None else now - (before or 0)


def explain_idle(
    idle_s: float, before: Snapshot, now: Snapshot, batch_size: int, env_tail: str, env_log: str
) -> str:
    """One line: how long, and the likeliest cause, from the gateway's side to the trainer's."""
    head = f"launch.sh: no training step for {idle_s:.0f} s: "
    requests, rejected = delta(now.requests, before.requests), delta(now.rejected, before.rejected)
    hint = env_log_hint(env_tail)
    if now.gate_holding and now.gate_waiting_for is not None:
        return head + (
            f"the gateway holds {now.gate_holding} request(s) at the on-policy gate for version "
            f"{now.gate_waiting_for}, which the trainer has not published (publish.gate_hold_s bounds the wait); "
            "read the trainer's log"
        )
    if requests == 0:
        cause = "the environment sent the gateway no generation request"
        return head + cause + (f"; {hint}" if hint else f"; read {env_log}")
    if requests and rejected and rejected >= requests / 2:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted((now.rejected_by_reason or {}).items())) or "?"
        return (
            head + f"the gateway rejected {rejected} of {requests} requests ({reasons}); last: "
            f"{(now.last_rejection or '?')[:300]}"
        )
    short = short_envs(now.envs or [], batch_size)
    if short:
        return (
            head
            + f"run-api waits for each environment's share of a batch, and {len(short)} lack theirs: "
            + "; ".join(short)
            + "; read their logs (logs/env-<name>.log)"
            + (f"; {hint}" if hint else "")
        )
    if now.queued is not None and now.queued < batch_size:
        sampled = f"the gateway served {requests} requests but " if requests else ""
        return (
            head
            + f"{sampled}run-api holds {now.queued} sequences and a batch needs {batch_size}; "
            + (hint or f"the environment's groups are not arriving; read {env_log}")
        )
    if now.queued is not None:
        return (
            head + f"run-api holds {now.queued} sequences (a batch is {batch_size}) but the trainer took none"
        )
    return head + (hint or f"read the logs, starting with {env_log}")
