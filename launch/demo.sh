#!/usr/bin/env bash
# Set up, then run the embedded default job: NPROC ranks (default 3: 1 drafter + 2 targets) on this
# machine, gloo on CPU or NCCL on GPUs. Extra arguments are key=value overrides or --config FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS-} bash launch/setup.sh  # the job needs no test tools
exec bash launch/run.sh "$@"
