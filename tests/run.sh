#!/usr/bin/env bash
# The project's test command (README, CI): create or reuse .venv (via launch.sh --setup), then run pytest.
# Extra arguments go to pytest: `bash tests/run.sh tests/unit` is the fast tier (in-process, about a minute),
# `bash tests/run.sh -k losses -x` picks tests, `bash tests/run.sh -m gpu tests/gpu` runs the GPU tier on a CUDA machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch.sh --setup
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
