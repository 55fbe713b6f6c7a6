"""`python -m environments.verifiers_v1_runner serve|preflight|evaluate --env.vf_env=FILE_OR_ID ...` (launch.sh runs
it with the v1 venv's interpreter for a `vf:` file that imports verifiers.v1)."""

from __future__ import annotations

from environments.common import run_cli
from environments.verifiers_v1_runner.env import VerifiersV1Env
from environments.verifiers_v1_runner.preflight import preflight

if __name__ == "__main__":
    run_cli(VerifiersV1Env, preflight)
