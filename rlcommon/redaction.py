"""One redaction of secrets for everything that shows or uploads a config: the dry run, W&B, the dashboard.

A value is secret when its key's last word names one (publish_token, api_key, teacher_api_key, gateway_token, a
password...; max_tokens and tokenizer are not), when it is the word after `--api-key`-like flags (or their `=`
form) in an argument list, or when it is the credential part of a URL (scheme://user:password@host).
"""

from __future__ import annotations

import re
from typing import Any

HIDDEN = "<hidden>"
SECRET_NAME = re.compile(r"(^|[._-])(token|api[_-]?key|secret|password|passwd|credentials?)$", re.IGNORECASE)
_URL_CREDENTIALS = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name.strip().lstrip("-")))


def redact_text(text: str) -> str:
    """The text with every URL's user:password@ part hidden."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{HIDDEN}@", text)


def _shown(value: Any) -> Any:
    """What a secret's value becomes: hidden when set, as it is when unset (so 'not set' still reads as such)."""
    return HIDDEN if value not in (None, "", [], {}) and not str(value).startswith("<") else value


def redact(data: Any) -> Any:
    """A copy of a config (dicts, lists, scalars) with its secrets hidden."""
    if isinstance(data, dict):
        return {
            k: _shown(v) if isinstance(k, str) and is_secret_name(k) else redact(v) for k, v in data.items()
        }
    if isinstance(data, list | tuple):
        return _redact_arguments(list(data))
    if isinstance(data, str):
        return redact_text(data)
    return data


def _redact_arguments(items: list[Any]) -> list[Any]:
    """An argument list: `--api-key X`, `--api-key=X` and `name=X` (a secret name) lose X."""
    out: list[Any] = []
    hide_next = False
    for item in items:
        if hide_next and isinstance(item, str):
            out.append(HIDDEN)
            hide_next = False
            continue
        hide_next = False
        if isinstance(item, str):
            name, sep, value = item.partition("=")
            if sep and value and is_secret_name(name.rpartition(".")[2]):
                out.append(f"{name}={HIDDEN}")
                continue
            if item.startswith("-") and not sep and is_secret_name(item):
                hide_next = True
        out.append(redact(item))
    return out


def redact_override(arg: str) -> str:
    """A dotted command-line override (inference.publish_token=...) with a secret's value hidden."""
    return _redact_arguments([arg])[0]  # type: ignore[no-any-return]
