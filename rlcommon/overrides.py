"""Dotted `key=value` overrides on a YAML mapping (`optim.lr=2e-5`, `vllm.dtype=float32`), renamed keys refused by
name, and validation errors written one line per key without printing a secret. The trainer's run config and the
gateway's own config both read their command lines through here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import yaml

MakeError = Callable[[str], Exception]


class OverrideError(ValueError):
    """An override that is not key=value, or that walks into a value as if it were a section."""


def parse_override(text: str, example: str, make_error: MakeError = OverrideError) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); `example` is shown when the text is not key=value."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise make_error(f"override {text!r} is not key=value (e.g. {example})")
    # YAML gives numbers, booleans, null and lists ([a, b]) their types; anything else stays a string.
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(
    data: dict[str, Any],
    overrides: Iterable[str],
    example: str,
    make_error: MakeError = OverrideError,
    drop_prefix: str = "",
) -> dict[str, Any]:
    """Set each dotted key in `data` (in place, sections created as needed); `drop_prefix` (e.g. "inference.") lets
    a section's own file take the keys as the run config spells them."""
    for text in overrides:
        path, value = parse_override(text, example, make_error)
        if drop_prefix and ".".join(path).startswith(drop_prefix):
            path = path[len(drop_prefix.rstrip(".").split(".")) :]
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise make_error(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def renamed_key(data: Mapping[str, Any], renamed: Iterable[str]) -> str | None:
    """The first of the `renamed` dotted keys that is set in `data` (a key that was renamed is refused by name, never
    left to the generic "extra inputs" error or silently ignored), or None."""
    for old in renamed:
        node: Any = data
        for part in old.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            return old
    return None


def shown_input(key: str, value: Any) -> str:
    """The offending value for an error message; never a secret, never a whole section (which may hold one)."""
    if "token" in key or "key" in key.rsplit(".", 1)[-1]:
        return " (value hidden)"
    if isinstance(value, dict):
        return ""
    return f" (got {value!r})"


def error_lines(errors: Iterable[Mapping[str, Any]], prefix: str = "") -> list[str]:
    """pydantic's `ValidationError.errors()` as `  key: message (got value)` lines; `prefix` names the section
    (e.g. "inference."), a model-level error is shown under the section's own name."""
    lines = []
    for err in errors:
        key = prefix + ".".join(str(p) for p in err["loc"])
        key = key.rstrip(".") or "<root>"
        lines.append(f"  {key}: {err['msg']}{shown_input(key, err.get('input'))}")
    return lines
