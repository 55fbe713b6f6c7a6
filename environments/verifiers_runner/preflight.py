"""The verifiers environment's pre-flight, before anything starts: verifiers imports, the environment loads with its
arguments (a missing package or a refused argument is named) and its training dataset yields rows with a prompt."""

from __future__ import annotations

import json

PREFLIGHT_ROWS = 3


def preflight(flags: dict[str, str]) -> list[str]:
    name = flags.get("vf_env", "")
    try:
        args = json.loads(flags.get("vf_env_args", "{}"))
    except json.JSONDecodeError as exc:
        return [f"rollout.env_args of {name!r} are not JSON: {exc}"]
    try:
        import verifiers  # noqa: F401
    except ImportError as exc:
        return [
            f"verifiers is not importable here ({exc}); launch.sh builds its venv when a vf: environment is named"
        ]
    from environments.verifiers_runner.env import load_environment

    try:
        env = load_environment(name, args, flags.get("tokenizer_name") or None)
    except ModuleNotFoundError as exc:
        return [
            f"verifiers environment {name!r}: missing module {exc.name!r} (install it into .venv-verifiers)"
        ]
    except (TypeError, ValueError) as exc:
        return [f"verifiers environment {name!r} with args {args}: {type(exc).__name__}: {exc}"]
    if env.dataset is None or len(env.dataset) == 0:
        return [f"verifiers environment {name!r} has no training dataset (only eval data?)"]
    rows = env.dataset.select(range(min(PREFLIGHT_ROWS, len(env.dataset)))).to_list()
    missing = [i for i, row in enumerate(rows) if not row.get("prompt")]
    if missing:
        return [f"verifiers environment {name!r}: dataset rows {missing} have no prompt"]
    print(f"note: verifiers environment {name!r}: {len(env.dataset)} training rows, {type(env).__name__}")
    return []
