"""Which policy version serves new requests, which versions are still in use, and which produced a completion.

Pure state (no I/O, no asyncio): the app calls it from one event loop. Version 0 is the base model.

Versions normally only grow. A trainer that restarts from a checkpoint rolls the gateway back to its checkpoint's
version ("replace_newer"): every newer version is retracted, and the version numbers after it are used again for
other adapters. Each rollback starts a new *generation*; a policy remembers the generation it was published in,
and the ledger stores (generation, version) per completion, so a completion sampled on an abandoned timeline is
never attributed to the version number that now names another adapter.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    version: int
    # The name the sampler serves it under: the base model's (vLLM answers it through a zero adapter,
    # inference/samplers/base_lora.py), or a fresh LoRA name per version.
    model_name: str
    adapter_path: str | None  # None for the base model
    generation: int = 0  # the registry's rollback count when it was published


def lora_name(version: int, generation: int = 0, run: int = 0) -> str:
    # A new name per version: reloading one name in place reuses prefix-cache blocks of the old weights. After a
    # rollback the same version number names another adapter, so later generations add their own suffix; on a
    # shared engine each attached run after the first adds its own (inference/policy/lease.py).
    name = f"policy-v{version}" if run == 0 else f"policy-r{run}-v{version}"
    return name if generation == 0 else f"{name}-g{generation}"


class Timeline:
    """The rollbacks made so far. Rollback i (which starts generation i + 1) went back to version `targets[i]`:
    versions above it were abandoned. What a policy of generation g and version v sampled is still attributable
    to v iff no rollback after g went below v."""

    def __init__(self) -> None:
        self._floors: list[int] = []  # _floors[g]: the lowest target of the rollbacks made after generation g

    @property
    def generation(self) -> int:
        return len(self._floors)

    def rollback(self, target: int) -> None:
        self._floors = [min(floor, target) for floor in self._floors] + [target]

    def valid(self, generation: int, version: int) -> bool:
        return generation >= len(self._floors) or version <= self._floors[generation]


ABANDONED = -1  # a lookup answer: sampled by a policy a rollback abandoned (never a published version, ge=0)
ID_BYTES = array("q").itemsize


def sequence_key(token_ids: list[int]) -> bytes:
    return _hasher(array("q", token_ids).tobytes()).digest()


def _hasher(data: bytes = b"") -> hashlib.blake2b:
    return hashlib.blake2b(data, digest_size=16)


@dataclass(frozen=True)
class Recorded:
    """A recorded sequence that a longer one starts with: an episode's previous turn (prompt + completion)."""

    length: int  # its token ids: the first `length` ids of the longer sequence
    version: int  # the version that sampled it; ABANDONED if a rollback abandoned that policy
    generation: int

    def sampled_by(self, policy: Policy) -> bool:
        return (policy.version, policy.generation) == (self.version, self.generation)


class PolicyRegistry:
    def __init__(self, base_model_name: str, max_staleness: int):
        self.max_staleness = max_staleness
        self.run = 0  # the attached run on a shared engine (0: the gateway's own run)
        self.timeline = Timeline()
        self._policies: dict[int, Policy] = {0: Policy(0, base_model_name, None)}  # the live timeline
        self._current = 0
        self._retracted: list[Policy] = []  # abandoned by a rollback, still loaded in the sampler
        self._in_flight: Counter[Policy] = Counter()  # by policy: version numbers repeat across generations

    @property
    def current(self) -> Policy:
        return self._policies[self._current]

    @property
    def base(self) -> Policy:
        return self._policies[0]

    @property
    def generation(self) -> int:
        return self.timeline.generation

    def acquire(self, episode: Recorded | None = None) -> Policy:
        """The policy a new request uses; pair with release() when the request is done. A request that continues
        an episode (`episode`: its previous turn, from VersionLedger.continued) gets the policy that sampled that
        turn while it is still loaded and live, so the episode stays on one version; else the current one."""
        policy = self.current
        if episode is not None and episode.version != ABANDONED:
            live = self._policies.get(episode.version)
            if live is not None and live.generation == episode.generation:
                policy = live
        self._in_flight[policy] += 1  # what is in flight is not removable(): it stays loaded until released
        return policy

    def release(self, policy: Policy) -> None:
        self._in_flight[policy] -= 1
        if self._in_flight[policy] <= 0:
            del self._in_flight[policy]

    def prepare(self, version: int, adapter_path: str | None) -> tuple[Policy, bool]:
        """The policy for make_current() to make `version` (at `adapter_path`) current, and whether the sampler must
        load it first: the live policy when it already holds that adapter, else a new one under a LoRA name no
        other policy has had (its generation is the one make_current() will be in)."""
        live = self._policies.get(version)
        if live is not None and live.adapter_path == adapter_path:
            return live, False
        if version == 0:
            raise ValueError("version 0 is the base model and takes no adapter")
        generation = self.generation + (1 if version <= self._current else 0)  # a rollback comes with it
        return Policy(version, lora_name(version, generation, self.run), adapter_path, generation), True

    def make_current(self, policy: Policy) -> list[Policy]:
        """Make `policy` (from prepare()) current. Every live version above it, and a different policy at its
        version, is retracted (a rollback: a new generation starts); returns what was retracted."""
        kept = self._policies.get(policy.version) == policy
        if policy.version == 0 and not kept:
            raise ValueError("version 0 is the base model and cannot be replaced")
        retracted = [
            p
            for v, p in sorted(self._policies.items())
            if v > policy.version or (v == policy.version and not kept)
        ]
        generation = self.generation + (1 if retracted else 0)
        if not kept and policy.generation != generation:
            raise ValueError(
                f"policy {policy.model_name} is of generation {policy.generation}, the registry will be at "
                f"{generation}: build it with prepare()"
            )
        if retracted:
            self.timeline.rollback(policy.version if kept else policy.version - 1)
            for p in retracted:
                del self._policies[p.version]
            self._retracted += [p for p in retracted if p.adapter_path is not None]
        self._policies[policy.version] = policy
        self._current = policy.version
        return retracted

    def publish(self, policy: Policy) -> None:
        """A version newer than the current one becomes current (nothing is retracted)."""
        if policy.version <= self._current:
            raise ValueError(
                f"version {policy.version} is not newer than the current version {self._current}"
            )
        self.make_current(policy)

    def start_run(self, run: int) -> list[Policy]:
        """A new run attached to a shared engine: back to the base model alone, on a fresh timeline, with LoRA
        names of run `run`. Returns the adapters the sampler still holds, for it to unload."""
        held = [p for p in self.held() if p.adapter_path is not None]
        self.run = run
        self.timeline = Timeline()
        self._policies = {0: self.base}
        self._current = 0
        self._retracted = []
        self._in_flight = Counter()
        return held

    def removable(self) -> list[Policy]:
        """Loaded adapters no request is using that can go: those outside the staleness window, and those a
        rollback retracted."""
        oldest_kept = self._current - self.max_staleness
        stale = [p for v, p in sorted(self._policies.items()) if 0 < v < oldest_kept]
        return [p for p in stale + self._retracted if not self._in_flight[p]]

    def remove(self, policy: Policy) -> None:
        if policy.version == 0 or policy == self.current:
            raise ValueError(f"{policy.model_name} cannot be removed (base or current)")
        if self._policies.get(policy.version) == policy:
            del self._policies[policy.version]
        elif policy in self._retracted:
            self._retracted.remove(policy)

    def loaded(self) -> list[Policy]:
        """The live policies, oldest first: what the sampler must hold again after a restart."""
        return [self._policies[v] for v in sorted(self._policies)]

    def held(self) -> list[Policy]:
        """Everything the sampler holds: the live policies and the retracted ones not unloaded yet."""
        return self.loaded() + list(self._retracted)

    def in_flight(self) -> dict[int, int]:
        counts: Counter[int] = Counter()
        for policy, n in self._in_flight.items():
            counts[policy.version] += n
        return dict(counts)

    def get(self, version: int) -> Policy | None:
        return self._policies.get(version)


class VersionLedger:
    """Bounded map from (prompt + completion token ids) to the policy version that sampled the completion. With a
    timeline, an entry whose policy a rollback abandoned looks up as ABANDONED.

    It also answers which recorded sequence a longer one starts with (continued()): a multi-turn episode's next
    prompt is its previous turn's prompt + completion and the environment's reply. Only the lengths of recorded
    sequences are tried, and the ids are hashed once, incrementally, whatever the number of lengths tried."""

    def __init__(self, capacity: int, timeline: Timeline | None = None):
        self.capacity = capacity
        self.timeline = timeline or Timeline()
        # key -> (generation, version, length tried by continued(); 0 for an empty completion, which nothing
        # continues: its key is a bare prompt, and every later request with that prompt would match it).
        self._entries: OrderedDict[bytes, tuple[int, int, int]] = OrderedDict()
        self._length_count: Counter[int] = Counter()
        self._lengths: list[int] = []  # sorted, distinct: the keys of _length_count

    def record(
        self, prompt_ids: list[int], completion_ids: list[int], version: int, generation: int = 0
    ) -> None:
        ids = prompt_ids + completion_ids
        key = sequence_key(ids)
        length = len(ids) if completion_ids else 0
        old = self._entries.pop(key, None)
        if old is not None:
            self._unindex(old[2])
        self._entries[key] = (generation, version, length)
        self._index(length)
        while len(self._entries) > self.capacity:
            self._unindex(self._entries.popitem(last=False)[1][2])

    def _index(self, length: int) -> None:
        if not length:
            return
        if not self._length_count[length]:
            bisect.insort(self._lengths, length)
        self._length_count[length] += 1

    def _unindex(self, length: int) -> None:
        if not length:
            return
        self._length_count[length] -= 1
        if not self._length_count[length]:
            del self._length_count[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]

    def continued(self, token_ids: list[int]) -> Recorded | None:
        """The longest recorded sequence (with a non-empty completion) that `token_ids` start with, the ids
        themselves included; None if there is none. Costs one hash over the ids up to the longest recorded length
        that fits, and one digest per distinct recorded length up to there."""
        lengths = self._lengths[: bisect.bisect_right(self._lengths, len(token_ids))]
        if not lengths:
            return None
        data = memoryview(array("q", token_ids[: lengths[-1]]).tobytes())
        hasher, hashed, found = _hasher(), 0, None
        for length in lengths:
            hasher.update(data[hashed * ID_BYTES : length * ID_BYTES])
            hashed = length
            entry = self._entries.get(hasher.copy().digest())
            if entry is not None and entry[2] == length:
                found = entry
        if found is None:
            return None
        generation, version, length = found
        valid = self.timeline.valid(generation, version)
        return Recorded(length, version if valid else ABANDONED, generation)

    def clear(self, timeline: Timeline) -> None:
        """Forget every completion (a new run on a shared engine), and follow that run's `timeline`."""
        self._entries.clear()
        self._length_count.clear()
        self._lengths = []
        self.timeline = timeline

    def lookup(self, token_ids: list[int]) -> int | None:
        """The version that sampled this sequence; None if the ledger never saw it (an environment that
        re-tokenized a chat, an evicted entry); ABANDONED if a rollback abandoned the policy that sampled it."""
        entry = self._entries.get(sequence_key(token_ids))
        if entry is None:
            return None
        generation, version, _ = entry
        return version if self.timeline.valid(generation, version) else ABANDONED

    def __len__(self) -> int:
        return len(self._entries)
