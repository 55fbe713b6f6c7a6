"""The trainer's client of the gateway: one method per route, each retried through transient failures (a gateway
or vLLM restart, a stalled process) within a budget. The one import across a process boundary in the project: the
gateway's wire types (inference.wire), so both sides parse the same bodies."""

from __future__ import annotations

import httpx

from inference.wire import (
    LEASE_HEADER,
    ExpectRequest,
    ExpectResponse,
    LookupRequest,
    LookupResponse,
    PolicyStatus,
    ProbeStatistic,
    PublishProbe,
    PublishRequest,
    PublishResponse,
    RefillRequest,
    RefillResponse,
)
from trainer.training.retries import RemoteComponent, checked

__all__ = [
    "ExpectResponse",
    "GatewayClient",
    "PolicyStatus",
    "ProbeStatistic",
    "PublishProbe",
    "PublishResponse",
    "verification_failure",
]

PUBLISH_TIMEOUT_S = 600.0  # an adapter load waits for a vLLM restart when one is under way


class GatewayClient:
    def __init__(
        self,
        url: str,
        publish_token: str | None = None,
        lease: str | None = None,
        timeout_s: float = 30.0,
        retry_budget_s: float = 300.0,
        log: str = "the gateway's log",
    ):
        headers = {"Authorization": f"Bearer {publish_token}"} if publish_token else {}
        if lease:  # a run attached to a shared engine (launch.sh engine) holds its lease
            headers[LEASE_HEADER] = lease
        self.url = url
        self.edge = RemoteComponent("gateway", url, log, retry_budget_s)
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _post(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        timeout = self._http.timeout if timeout_s is None else httpx.Timeout(timeout_s)
        response = self.edge.call(lambda: checked(self._http.post(path, json=body, timeout=timeout)), path)
        return dict(response.json())

    def publish(
        self,
        version: int,
        adapter_path: str | None,
        replace_newer: bool = False,
        probe: PublishProbe | None = None,
    ) -> PublishResponse:
        """Make `version` the served policy. A retry of a publish that already landed is answered as a no-op by the
        gateway; `replace_newer` (a trainer restarted from a checkpoint) retracts every version above it. With a
        `probe` the gateway refuses (HTTPStatusError 422, see verification_failure) an adapter whose logprobs
        differ from the trainer's."""
        body = PublishRequest(
            version=version, adapter_path=adapter_path, replace_newer=replace_newer, probe=probe
        )
        raw = self._post("/policy/publish", body.model_dump(exclude_none=True), PUBLISH_TIMEOUT_S)
        return PublishResponse.model_validate(raw)

    def expect(
        self,
        version: int,
        hold_s: float,
        quota: int | None = None,
        refill_s: float = 1.0,
        env_quotas: dict[str, int] | None = None,
        lead: int = 0,
        batch_taken: bool = False,
        group_size: int | None = None,
        env_group_sizes: dict[str, int] | None = None,
    ) -> ExpectResponse:
        """Close the on-policy gate until `version` is published (or open it: a version not newer than the
        current one); `quota` sequences per version from then on, `env_quotas` of them per environment of a mixed
        run (inference/policy/gate.py), each prompt's first request reserving its group (`group_size`, per
        environment `env_group_sizes`)."""
        body = ExpectRequest(
            version=version,
            hold_s=hold_s,
            quota=quota,
            refill_s=refill_s,
            env_quotas=env_quotas,
            lead=lead,
            batch_taken=batch_taken,
            group_size=group_size,
            env_group_sizes=env_group_sizes,
        ).model_dump()
        return ExpectResponse.model_validate(self._post("/policy/expect", body))

    def refill(self, short: dict[str, int]) -> RefillResponse:
        """Ask the gate to let these short environments of a mixed run (sequences short of their share) go on on
        the current version (inference/policy/gate.py refill_envs)."""
        body = RefillRequest(short=short).model_dump()
        return RefillResponse.model_validate(self._post("/policy/refill", body))

    def lookup(self, sequences: list[list[int]]) -> list[int | None]:
        body = LookupRequest(sequences=sequences).model_dump()
        return LookupResponse.model_validate(self._post("/policy/lookup", body)).versions

    def status(self) -> PolicyStatus:
        response = self.edge.call(lambda: checked(self._http.get("/policy")), "/policy")
        return PolicyStatus.model_validate(response.json())


def verification_failure(exc: httpx.HTTPStatusError) -> tuple[str, float | None] | None:
    """(message, max |logprob difference|) when the gateway refused a publish because the loaded adapter did not
    reproduce the trainer's probe logprobs; None for any other error."""
    if exc.response.status_code != 422:
        return None
    try:
        err = exc.response.json().get("error", {})
    except ValueError:
        return None
    if not isinstance(err, dict) or err.get("type") != "verification_failed":
        return None
    diff = err.get("max_abs_diff")
    return str(err.get("message")), float(diff) if isinstance(diff, int | float) else None
