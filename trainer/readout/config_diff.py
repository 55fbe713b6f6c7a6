"""What two or more runs' configs differ in, beyond where they ran: the list a comparison report puts under its table,
so that a local/Tinker comparison that also changed the learning rate says so.

Pure: takes the parsed config.yaml of each run."""

from __future__ import annotations

from typing import Any

# Filled in by each launch (its folder, its addresses, the backend the comparison is about), not chosen by the recipe.
PER_RUN = frozenset(
    {
        "trainer.output_dir",
        "launch.backend",
        "launch.run_api_url",
        "launch.gateway_url",
        "tinker.tokenizer",
        "model.path",  # compared as the folder it resolved to: model_of
    }
)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values (lists and empty sections are leaves)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def backend_of(config: dict[str, Any]) -> str:
    launch = config.get("launch")
    return str(launch.get("backend", "local")) if isinstance(launch, dict) else "local"


def model_of(config: dict[str, Any]) -> str:
    """The base model as the folder its name resolved to on the launching box: a local run's model.path; a Tinker
    run's model.path is the name Tinker knows, and tinker.tokenizer that folder."""
    flat = flatten(config)
    if backend_of(config) == "tinker" and flat.get("tinker.tokenizer"):
        return str(flat["tinker.tokenizer"])
    return str(flat.get("model.path", ""))


def config_differences(configs: dict[str, dict[str, Any]]) -> list[str]:
    """One line per key whose value is not the same in every run ("key: run_a=..., run_b=..."). The local gateway's
    `inference.*` settings are compared only between runs of the same backend: a Tinker run samples on Tinker."""
    flat = {name: flatten(cfg) for name, cfg in configs.items()}
    backends = {backend_of(cfg) for cfg in configs.values()}
    lines = []
    models = {name: model_of(cfg) for name, cfg in configs.items()}
    if len(set(models.values())) > 1:
        lines.append("model: " + ", ".join(f"{run}={value}" for run, value in models.items()))
    keys = sorted(set().union(*(f.keys() for f in flat.values())))
    missing = object()
    for key in keys:
        if key in PER_RUN or (len(backends) > 1 and key.split(".")[0] == "inference"):
            continue
        values = {run: f.get(key, missing) for run, f in flat.items()}
        if len({repr(v) for v in values.values()}) > 1:
            shown = ", ".join(f"{run}={'(unset)' if v is missing else repr(v)}" for run, v in values.items())
            lines.append(f"{key}: {shown}")
    return lines
