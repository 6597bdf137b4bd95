#!/usr/bin/env bash
# A/B of two `ep` builds on the GPU machine, alternated so that drift between runs shows.
# Before: bash scripts/gpu-bundle.sh (bundle/ep = this tree), and a copy of the other build as
# bundle/ep-A (e.g. `cp bundle/ep /tmp/ep-A` before re-bundling, then `cp /tmp/ep-A bundle/`), or
# both from commits at once: bash scripts/gpu-ab-builds.sh REV A_REV [B_REV].
# Usage (device tool): bash scripts/gpu-ab.sh [rounds] -- <ep bench arguments after --backend gpu>
#   e.g. bash scripts/gpu-ab.sh 2 -- --ranks 2 --sms-sweep 24,8,64
# The runs are gpu-verify.sh's `ab-args` step (its budget, logs archive and table).
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=1
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] && shift
args="$*"
# gpu-verify adds --backend gpu itself (older usage passed it here).
AB_ROUNDS=$rounds AB_ARGS="${args//--backend gpu/}" exec bash scripts/gpu-verify.sh ab-args
