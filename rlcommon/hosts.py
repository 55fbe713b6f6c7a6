"""Host names that reach only this machine: a gateway bound to one needs no publish token, and a launcher that binds
one connects to it as 127.0.0.1."""

from __future__ import annotations

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
