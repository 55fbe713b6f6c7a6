"""The verifiers environment's pre-flight, before anything starts: verifiers imports, the environment loads with its
arguments (a missing package or a refused argument is named), its training dataset yields rows with a prompt, and
an environment that offers tools has a vLLM that takes them."""

from __future__ import annotations

import json

PREFLIGHT_ROWS = 3


def preflight(flags: dict[str, str]) -> list[str]:
    from environments.common import verifiers_preflight_start

    name, args, problems = verifiers_preflight_start(flags, "verifiers", "a vf: environment")
    if problems:
        return problems
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
    from environments.verifiers_runner.compat import tools_of

    problem = tool_problem(name, type(env).__name__, bool(tools_of(env)), flags.get("vllm_extra_args"))
    if problem:
        return [problem]
    print(f"note: verifiers environment {name!r}: {len(env.dataset)} training rows, {type(env).__name__}")
    return []


def tool_problem(name: str, kind: str, offers_tools: bool, vllm_extra_args: str | None) -> str | None:
    """vLLM answers a chat request that offers tools (tool_choice auto, verifiers' ToolEnv) with a 400 unless it
    was started with a tool call parser, and every group of the run would be dropped. `vllm_extra_args` is the
    run's inference.vllm.extra_args as JSON (absent where the sampler is not a local vLLM)."""
    if vllm_extra_args is None or not offers_tools:
        return None
    args = [str(a) for a in json.loads(vllm_extra_args)]
    parser = any(a == "--tool-call-parser" or a.startswith("--tool-call-parser=") for a in args)
    if "--enable-auto-tool-choice" in args and parser:
        return None
    return (
        f"verifiers environment {name!r} offers tools ({kind}), and vLLM refuses such requests unless started "
        "with a tool call parser: set inference.vllm.extra_args='[--enable-auto-tool-choice, --tool-call-parser, "
        "NAME]' with the parser that fits the model's chat template (vLLM's tool calling docs list them); "
        f"inference.vllm.extra_args is {args}"
    )
