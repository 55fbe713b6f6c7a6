"""Requests that vLLM died on, kept from taking it down in a loop.

A request cut off by vLLM's death is sent again once vLLM is back (a kill -9 from outside must cost no request).
If vLLM dies again while that request is in flight, the request itself is the likely cause: it is not sent again,
it is answered 422 `quarantined`, and its fingerprint (route and body) is remembered so that a client retrying the
same body is answered at once instead of restarting the engine again. The gateway's rejection counters (GET
/policy) count each such answer.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from inference.errors import BackendError

DEATHS_BEFORE_QUARANTINE = 2  # the second death with the request in flight
REMEMBERED = 256  # fingerprints kept, oldest forgotten first


def fingerprint(path: str, body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{path}\n{text}".encode()).hexdigest()


class Quarantine:
    """Shared by the replicas of a replica set: a request that killed one replica and then another is held too."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, str] = OrderedDict()
        self._deaths: OrderedDict[str, dict[str, str]] = OrderedDict()  # fingerprint -> {vLLM process: why}

    def __len__(self) -> int:
        return len(self._held)

    def check(self, path: str, body: dict[str, Any]) -> None:
        """Raise the quarantine error for a body vLLM already died on twice. Free while nothing is held: the
        fingerprint (a JSON dump and a hash of the body) is computed only once something is."""
        if not self._held:
            return
        why = self._held.get(fingerprint(path, body))
        if why is not None:
            raise self._error(path, why, again=True)

    def died_on(self, path: str, body: dict[str, Any], process: str, why: str) -> BackendError | None:
        """Record that vLLM process `process` died with this request in flight; the quarantine error once
        DEATHS_BEFORE_QUARANTINE distinct processes have (identical requests cut by one death count once)."""
        key = fingerprint(path, body)
        deaths = self._deaths.setdefault(key, {})
        deaths[process] = why
        self._deaths.move_to_end(key)
        while len(self._deaths) > REMEMBERED:
            self._deaths.popitem(last=False)
        if len(deaths) < DEATHS_BEFORE_QUARANTINE:
            return None
        reasons = "; ".join(deaths.values())
        self._held[key] = reasons
        while len(self._held) > REMEMBERED:
            self._held.popitem(last=False)
        return self._error(path, reasons, again=False)

    @staticmethod
    def _error(path: str, why: str, again: bool) -> BackendError:
        seen = "the same request was quarantined before" if again else "it was in flight at each death"
        return BackendError(
            422,
            f"{path}: vLLM died {DEATHS_BEFORE_QUARANTINE} times while serving this request ({why}) and {seen}: "
            "it is not sent to vLLM again, so that it cannot take the engine down in a loop. Change the request "
            "(for example, ask for prompt logprobs with n=1 and one prompt) or report it with the gateway's log",
            reason="quarantined",
        )
