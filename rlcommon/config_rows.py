"""The configuration reference's rows, read from a pydantic model: one row per key (dotted key, type, default, the
field's own description), a nested model as a "section" row followed by its own table. Both processes' configs are
described this way (the trainer's run config, the gateway's `inference:` section), so the page cannot drift from
the code. Pure: no I/O."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    meaning: str

    def markdown(self) -> str:
        return f"| `{self.key}` | {self.type} | {self.default} | {self.meaning} |"


@dataclass(frozen=True)
class Table:
    key: str  # the section's dotted key
    rows: list[Row]


def type_text(annotation: Any) -> str:
    """A field's type as the reference writes it: `int \\| None`, `auto \\| cpu \\| cuda`, `list[str]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_text(a) for a in args)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if annotation is type(None):
        return "None"
    if origin in (list, dict, tuple, set):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if origin is not None:
        return type_text(origin)
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (alone or or-None), if it holds one."""
    candidates = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def list_item_model(annotation: Any) -> type[BaseModel] | None:
    """The model each entry of a list field holds (`list[EnvEntry]`), if the entries are models."""
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        return item if isinstance(item, type) and issubclass(item, BaseModel) else None
    return None


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return f"`{field.default_factory()!r}`"  # type: ignore[call-arg]
    return f"`{field.default!r}`"


def tables(model: type[BaseModel], prefix: str, section_meaning: dict[str, str] | None = None) -> list[Table]:
    """`model`'s table under the dotted `prefix`, then one table per nested model, depth first. A nested model's
    row says "section"; its meaning is the field's description, else `section_meaning[key]`. A list of models
    (`rollout.envs`) has its row, then its entries' keys (`rollout.envs.weight`) in the same table."""
    rows: list[Row] = []
    nested: list[Table] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = nested_model(field.annotation)
        if inner is not None:
            meaning = field.description or (section_meaning or {}).get(key, "")
            rows.append(Row(key, "section", "", meaning))
            nested += tables(inner, f"{key}.", section_meaning)
            continue
        rows.append(Row(key, type_text(field.annotation), default_text(field), field.description or ""))
        item = list_item_model(field.annotation)
        if item is not None:
            (entries, *deeper) = tables(item, f"{key}.", section_meaning)
            rows += [Row(r.key, r.type, r.default, f"each entry of {key}: {r.meaning}") for r in entries.rows]
            nested += deeper
    return [Table(prefix.rstrip("."), rows), *nested]
