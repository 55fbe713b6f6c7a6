"""The exported folder's README.md: a Hugging Face model card (YAML front matter the hub reads, then prose) that says
what the base is, what was trained and how, what the run's held-out evaluations measured for the base and for this
version, where it came from, and that the base's licence applies. Pure: the caller reads the files."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import yaml

from trainer.export.origin import ExportSource

LICENCE_LINE = re.compile(r"^license:\s*(?P<value>\S.*)$", re.MULTILINE)


def base_licence(readme: str | None) -> str | None:
    """The `license:` of a base model card's front matter, if it declares one."""
    if not readme or not readme.startswith("---"):
        return None
    front = readme.split("---", 2)[1] if readme.count("---") >= 2 else ""
    found = LICENCE_LINE.search(front)
    return found["value"].strip().strip("'\"") if found else None


def environments(config: dict[str, Any]) -> list[str]:
    rollout = config.get("rollout") or {}
    envs = rollout.get("envs") or []
    if envs:
        return [
            f"{e.get('name') or e.get('env')} ({e.get('env')}, weight {e.get('weight', 1)})" for e in envs
        ]
    return [str(rollout.get("env"))] if rollout.get("env") else []


def eval_table(evals: list[dict[str, Any]], version: int | None) -> list[str]:
    """Markdown rows: each metric the run's held-out evaluations recorded for the base and for `version`."""

    def ok(row: dict[str, Any]) -> bool:
        return row.get("status") == "ok"

    base = [r for r in evals if ok(r) and r.get("target") == "base"]
    this = [r for r in evals if ok(r) and version is not None and r.get("policy_version") == version]
    if not base and not this:
        return []
    keys = sorted(
        {k for r in base + this for k in r if k.startswith("eval/") and isinstance(r[k], int | float)}
    )
    lines = ["| environment | metric | base | this model |", "| --- | --- | --- | --- |"]
    for env in sorted({str(r.get("env")) for r in base + this}):
        for key in keys:
            cell = [_value(rows, env, key) for rows in (base, this)]
            if cell != ["", ""]:
                lines.append(f"| {env} | {key.removeprefix('eval/')} | {cell[0]} | {cell[1]} |")
    return lines if len(lines) > 2 else []


def _value(rows: list[dict[str, Any]], env: str, key: str) -> str:
    values = [r[key] for r in rows if str(r.get("env")) == env and isinstance(r.get(key), int | float)]
    return f"{values[-1]:.4g}" if values else ""


def _front_matter(src: ExportSource, merged: bool, licence: str | None) -> dict[str, Any]:
    front: dict[str, Any] = {
        "library_name": "transformers" if merged else "peft",
        "tags": ["reinforcement-learning", "lora", *(["merged"] if merged else [])],
    }
    if (
        src.base.hub_id
    ):  # the hub checks base_model against its repositories: a local folder is named in the text
        front["base_model"] = src.base.hub_id
    if licence:
        front["license"] = licence
    return front


def _training_lines(src: ExportSource) -> list[str]:
    """The card's "Training" section: environments, steps, loss and LoRA settings as the run recorded them."""
    cfg = src.config
    lora, loss, rollout, optim = (cfg.get(k) or {} for k in ("lora", "loss", "rollout", "optim"))
    envs = environments(cfg)
    steps = f"{src.step} of {rollout.get('num_steps')}" if src.step is not None else "unknown"
    return [
        "## Training",
        "",
        f"- environments: {', '.join(envs) if envs else 'not recorded'}",
        f"- steps: {steps}; {rollout.get('groups_per_step', '?')} groups of {rollout.get('group_size', '?')} "
        "samples per step",
        f"- loss: `{loss.get('name', '?')}` (reduction `{loss.get('reduction', '?')}`); learning rate "
        f"{optim.get('lr', '?')}",
        f"- LoRA: rank {lora.get('rank', '?')}, alpha {lora.get('alpha', '?')}, modules {lora.get('target_modules', '?')}",
    ]


def model_card(
    src: ExportSource,
    merged: bool,
    evals: list[dict[str, Any]],
    licence: str | None,
    revision: str,
    facts: dict[str, Any] | None = None,
) -> str:
    lines = [
        "---",
        yaml.safe_dump(_front_matter(src, merged, licence), sort_keys=False).rstrip(),
        "---",
        "",
        f"# {src.base.name.split('/')[-1]} + RL LoRA, {src.label}",
        "",
        f"{'The base model with a LoRA adapter merged into its weights' if merged else 'A LoRA adapter'} trained by "
        f"reinforcement learning on `{src.base.name}`"
        + (f" (revision `{src.base.revision}`)" if src.base.revision else "")
        + ".",
        "",
        *_training_lines(src),
    ]
    if facts:
        lines.append(f"- merged in {facts['merged_in']}, saved in {facts['dtype']}")
    table = eval_table(evals, src.version)
    lines += ["", "## Held-out evaluation", ""]
    lines += table or ["The run recorded no held-out evaluation of the base and this version."]
    exported = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    lines += [
        "",
        "## Origin",
        "",
        f"- run folder: `{src.run_dir.name if src.run_dir else src.adapter.name}`, {src.label}",
        f"- exported {exported} by project revision `{revision}`",
        "",
        "## Licence",
        "",
        f"This model is derived from `{src.base.name}` and is bound by its licence"
        + (f" (`{licence}`)" if licence else "")
        + ": read it before you use or share this model.",
        "",
    ]
    return "\n".join(lines)
