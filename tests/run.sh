#!/usr/bin/env bash
# The project's test command (README, CI): create or reuse .venv (via launch.sh --setup), then run pytest.
# Extra arguments go to pytest: `bash tests/run.sh -n 3 tests/unit` is the fast tier (in-process, on three workers),
# `bash tests/run.sh -k losses -x` picks tests, `bash tests/run.sh -m gpu tests/gpu` runs the GPU tier on a CUDA machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch.sh --setup
# The dashboard's browser test drives the OS's Chromium through its chromedriver (no browser is downloaded at test
# time): installed here where this user may (root with apt-get); elsewhere that test skips and says how to install.
install_chromium() {
  if ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[tests] installing chromium and chromium-driver (apt-get) for the dashboard's browser test" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
      || echo "[tests] could not install chromium: the dashboard's browser test will skip" >&2
  fi
}
# The verifiers test trains through a verifiers environment, which runs in a venv of its own (.venv-verifiers, built
# once, about 2 minutes). Where it cannot be built, that test skips and says how to build it. The same for verifiers
# v1 (verifiers 0.4, which needs openai<3): .venv-verifiers-v1, about 1.5 minutes once. The two build side by side,
# each into its own folder (a build already under way, CI's, is waited for: launch.sh locks each venv).
setup_for_servers() {
  local jobs=()
  install_chromium &
  jobs+=($!)
  bash launch.sh --setup-verifiers || echo "[tests] could not set up .venv-verifiers: the verifiers test will skip" >&2 &
  jobs+=($!)
  bash launch.sh --setup-verifiers-v1 \
    || echo "[tests] could not set up .venv-verifiers-v1: the verifiers v1 test will skip" >&2 &
  jobs+=($!)
  wait "${jobs[@]}"
}
# The test that runs tinker-cookbook 0.6.1's own loops on the service needs the cookbook: installed without its
# dependencies (the dev extra holds them) because one, tml-renderers (for two model families only), is not on every
# package index. Where it cannot be installed, that test skips.
PY="${VENV:-.venv}/bin/python"
if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("tinker-cookbook") != "0.6.1")' 2>/dev/null; then
  echo "[tests] installing tinker-cookbook 0.6.1 (--no-deps) for the cookbook test" >&2
  "$PY" -m pip install -q --no-deps "tinker-cookbook==0.6.1" || echo "[tests] could not install tinker-cookbook: its test will skip" >&2
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Python may keep the bytecode of what it compiles (the project's modules, pytest's rewritten test modules): where the
# environment forbids it (PYTHONDONTWRITEBYTECODE, set on some CI machines), every process of the suite (hundreds:
# launchers, trainers, environments, gateways, reports) compiles the project from source again, and each pytest run
# rewrites every test module again (the unit tier from a fresh clone on the 2-core box: 78.7 s, and 72.7-75.0 s in
# the same clone once the bytecode was kept).
unset PYTHONDONTWRITEBYTECODE
# No arguments: the whole suite, by tier. The unit tier (in-process, no server) runs on three workers: its tests wait
# for about a third of their time (the timeouts, retries and deadlines they check), so on the 2-core box two workers
# left the cores idle that long (100 s of CPU in 70 s of wall time) and a third fills the waits (median of three runs
# 65.4 -> 56.8 s; a fourth adds its collection, about 10 s of CPU, and was slower: 67.5 s). Meanwhile what only the
# servers' tier needs (Chromium, the verifiers venvs: the package index and the disk) is set up
# beside it. Then the integration tier in two pytest runs side by side: its tests that start real servers one at a
# time, as their timings assume, and the few marked beside_servers (they start none and time nothing) on the CPU that
# the servers' tests leave idle while they wait (about 0.9 of the 2-core box's cores). (pytest-xdist's --dist
# loadgroup would do this in one run, but xdist 3.8 writes the group into a test id attribute that pytest 9 no longer
# reads: no group held.)
# On a machine whose torch sees a CUDA GPU the GPU tier (tests/gpu, marker gpu, deselected by pyproject's addopts)
# runs too; elsewhere it is skipped, saying so.
if [ $# -eq 0 ]; then
  # A pipe, not a process substitution: `wait` must not wait on the reader of the set-up's own output.
  setup_for_servers 2>&1 | sed -u 's/^/[set-up beside the unit tier] /' >&2 &
  beside=$!
  unit=0
  "$PY" -m pytest -n 3 tests/unit || unit=$?
  wait "$beside" || true  # best effort: what is missing makes its tests skip, saying why
  marks="not bench and not gpu"  # pyproject's addopts, which a second -m replaces
  mapfile -t beside_files < <(grep -l "pytest.mark.beside_servers" tests/integration/test_*.py)
  (
    set +e
    [ "${#beside_files[@]}" -gt 0 ] || exit 0
    "$PY" -m pytest -m "beside_servers and $marks" "${beside_files[@]}" 2>&1 | sed -u 's/^/[beside the servers] /'
    exit "${PIPESTATUS[0]}"
  ) &
  beside=$!
  servers_rc=0
  "$PY" -m pytest -m "not beside_servers and $marks" tests/integration || servers_rc=$?
  wait "$beside" || exit $?
  [ "$servers_rc" = 0 ] || exit "$servers_rc"
  if "$PY" -m tests.gpu.available; then
    "$PY" -m pytest -m gpu tests/gpu || exit $?
  fi
  exit "$unit"
fi
# Arguments naming only tests/unit paths (the fast tier) need none of the servers' set-up.
servers=1
for arg in "$@"; do
  case "$arg" in
    tests/unit | tests/unit/* | ./tests/unit | ./tests/unit/*) [ "$servers" = 1 ] && servers=unit-only ;;
    tests/* | ./tests/*) servers=yes ;;
  esac
done
if [ "$servers" != unit-only ]; then setup_for_servers; fi
exec "$PY" -m pytest "$@"
