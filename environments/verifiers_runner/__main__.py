"""`python -m environments.verifiers_runner serve|preflight --env.vf_env=ID_OR_FILE ...` (launch.sh runs it with the
verifiers venv's interpreter for a `vf:` environment)."""

from __future__ import annotations

from environments.common import run_cli
from environments.verifiers_runner.env import VerifiersEnv
from environments.verifiers_runner.preflight import preflight

if __name__ == "__main__":
    run_cli(VerifiersEnv, preflight)
