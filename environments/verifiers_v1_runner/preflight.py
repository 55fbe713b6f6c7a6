"""The verifiers v1 environment's pre-flight, before anything starts: verifiers.v1 imports, the environment builds
with its arguments (a missing package, a refused config key or an unknown harness is named), its taskset yields
tasks with a prompt; a harness that prepares its program at run time (uv and a package registry) gets a warning."""

from __future__ import annotations

from itertools import islice

PREFLIGHT_TASKS = 3


def preflight(flags: dict[str, str]) -> list[str]:
    from environments.common import verifiers_preflight_start

    name, args, problems = verifiers_preflight_start(flags, "verifiers.v1", "a v1 environment")
    if problems:
        return problems
    import verifiers.v1 as vf

    from environments.verifiers_v1_runner.env import load_env

    try:
        env = load_env(name, args, flags.get("tokenizer_name") or None)
        tasks = list(islice(iter(env.taskset), PREFLIGHT_TASKS))
    except ModuleNotFoundError as exc:
        what = f"missing module {exc.name!r}" if exc.name else str(exc)
        return [f"verifiers v1 environment {name!r}: {what} (install it into .venv-verifiers-v1)"]
    except (TypeError, ValueError, AttributeError) as exc:
        return [f"verifiers v1 environment {name!r} with args {args}: {type(exc).__name__}: {exc}"]
    if not tasks:
        return [f"verifiers v1 environment {name!r}: its taskset yields no task"]
    missing = [i for i, task in enumerate(tasks) if task.data.prompt is None]
    if missing:
        return [f"verifiers v1 environment {name!r}: tasks {missing} have no prompt"]
    for role, harness in env._harnesses.items():
        # verifiers' own chat and agent harnesses sync their program with uv against a package registry in each
        # rollout (UV_OFFLINE forced off): offline, every rollout fails in setup.
        if type(harness).setup is not vf.Harness.setup:
            print(
                f"warning: verifiers v1 environment {name!r}: role {role!r} uses harness {harness.config.id!r}, which prepares "
                "its program at run time (uv and a package registry, in every rollout); export "
                "environments.verifiers_v1_runner.chat_harness.ChatHarness from the taskset module for an offline "
                "plain chat, or set rollout.env_args.harness"
            )
    print(
        f"note: verifiers v1 environment {name!r}: {type(env).__name__}, harness(es) "
        f"{sorted({h.config.id for h in env._harnesses.values()})}"
    )
    return []
