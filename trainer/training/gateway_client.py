"""The trainer's client of the gateway: one method per route. The one import across a process boundary in the
project: the gateway's wire types (inference.wire), so both sides parse the same bodies."""

from __future__ import annotations

import httpx

from inference.wire import LookupRequest, LookupResponse, PolicyStatus, PublishRequest, PublishResponse


class GatewayClient:
    def __init__(self, url: str, publish_token: str | None = None, timeout_s: float = 600.0):
        headers = {"Authorization": f"Bearer {publish_token}"} if publish_token else {}
        self.url = url
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"gateway {path} answered {r.status_code}: {r.text}")
        return dict(r.json())

    def publish(self, version: int, adapter_path: str) -> PublishResponse:
        body = PublishRequest(version=version, adapter_path=adapter_path).model_dump()
        return PublishResponse.model_validate(self._post("/policy/publish", body))

    def lookup(self, sequences: list[list[int]]) -> list[int | None]:
        body = LookupRequest(sequences=sequences).model_dump()
        return LookupResponse.model_validate(self._post("/policy/lookup", body)).versions

    def status(self) -> PolicyStatus:
        r = self._http.get("/policy")
        r.raise_for_status()
        return PolicyStatus.model_validate(r.json())
