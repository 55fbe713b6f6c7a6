"""Which policy version serves new requests, which versions are still in use, and which produced a completion.

Pure state (no I/O, no asyncio): the app calls it from one event loop. Version 0 is the base model.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    version: int
    model_name: str  # the name vLLM serves it under: the base model's, or a fresh LoRA name per version
    adapter_path: str | None  # None for the base model


def lora_name(version: int) -> str:
    # A new name per version: reloading one name in place reuses prefix-cache blocks of the old weights.
    return f"policy-v{version}"


class PolicyRegistry:
    def __init__(self, base_model_name: str, max_staleness: int):
        self.max_staleness = max_staleness
        self._policies: dict[int, Policy] = {0: Policy(0, base_model_name, None)}
        self._current = 0
        self._in_flight: Counter[int] = Counter()

    @property
    def current(self) -> Policy:
        return self._policies[self._current]

    def acquire(self) -> Policy:
        """The policy a new request uses; pair with release() when the request is done."""
        policy = self.current
        self._in_flight[policy.version] += 1
        return policy

    def release(self, policy: Policy) -> None:
        self._in_flight[policy.version] -= 1
        if self._in_flight[policy.version] <= 0:
            del self._in_flight[policy.version]

    def publish(self, policy: Policy) -> None:
        if policy.version <= self._current:
            raise ValueError(
                f"version {policy.version} is not newer than the current version {self._current}"
            )
        self._policies[policy.version] = policy
        self._current = policy.version

    def removable(self) -> list[Policy]:
        """Loaded adapters outside the staleness window that no request is using."""
        oldest_kept = self._current - self.max_staleness
        return [
            p for v, p in sorted(self._policies.items()) if 0 < v < oldest_kept and self._in_flight[v] == 0
        ]

    def remove(self, version: int) -> None:
        if version in (0, self._current):
            raise ValueError(f"version {version} cannot be removed (base or current)")
        self._policies.pop(version, None)

    def loaded(self) -> list[Policy]:
        return [self._policies[v] for v in sorted(self._policies)]

    def in_flight(self) -> dict[int, int]:
        return dict(self._in_flight)

    def get(self, version: int) -> Policy | None:
        return self._policies.get(version)


def sequence_key(token_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()


class VersionLedger:
    """Bounded map from (prompt + completion token ids) to the policy version that sampled the completion."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[bytes, int] = OrderedDict()

    def record(self, prompt_ids: list[int], completion_ids: list[int], version: int) -> None:
        key = sequence_key(prompt_ids + completion_ids)
        self._entries[key] = version
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def lookup(self, token_ids: list[int]) -> int | None:
        return self._entries.get(sequence_key(token_ids))

    def __len__(self) -> int:
        return len(self._entries)
