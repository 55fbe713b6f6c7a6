"""`python -m environments.upstream FILE serve|evaluate|preflight ...`: see environments/upstream/envfile.py."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from environments.common import chat_template_returns_ids, configure_logging, eval_target_problem
from environments.upstream import envfile
from environments.upstream.envfile import EnvFileError, serve
from environments.upstream.probe import preflight


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[1] not in ("serve", "evaluate", "preflight"):
        print(envfile.__doc__, file=sys.stderr)
        return 2
    path, command, rest = Path(args[0]), args[1], args[2:]
    chat_template_returns_ids()
    if command == "preflight":
        return preflight(path, rest)
    configure_logging()
    problem = eval_target_problem(rest) if command == "evaluate" else None
    if problem:
        print(f"environment: {problem}", file=sys.stderr)
        return 2
    try:
        return serve(path, rest, command)
    except EnvFileError as exc:
        print(f"environment: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
