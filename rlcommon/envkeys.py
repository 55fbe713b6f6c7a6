"""How a generation request names its environment: the launcher gives each environment process the bearer key
`rl-env:<name>`, and the gateway reads it back, so that a mixed run's on-policy gate can hold each environment to its
own share of a batch (inference/policy/gate.py)."""

from __future__ import annotations

ENV_KEY_PREFIX = "rl-env:"


def env_key(name: str) -> str:
    """The bearer key environment `name` sends with its generation requests."""
    return ENV_KEY_PREFIX + name


def env_of_key(key: str) -> str | None:
    """The environment a bearer key names; None for any other key."""
    if not key.startswith(ENV_KEY_PREFIX):
        return None
    return key[len(ENV_KEY_PREFIX) :].strip() or None
