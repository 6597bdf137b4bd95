#!/usr/bin/env bash
# A/B of two `ep` builds on the GPU machine, alternated so that drift between runs shows.
# Before: bash scripts/gpu-bundle.sh (bundle/ep = this tree), and a copy of the other build as
# bundle/ep-A (e.g. `cp bundle/ep /tmp/ep-A` before re-bundling, then `cp /tmp/ep-A bundle/`).
# Usage (device tool): bash scripts/gpu-ab.sh [rounds] -- <ep bench arguments>
#   e.g. bash scripts/gpu-ab.sh 2 -- --backend gpu --ranks 2 --sms-sweep 24,8,64
# Each run's full output goes to $OUT (or bundle/out) as ab-<build>-<round>.log; the summary
# lines (figures, verification, mismatches) are printed, A and B interleaved.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
rounds=1
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] && shift
[ -x bundle/ep ] && [ -x bundle/ep-A ] || { echo "need bundle/ep and bundle/ep-A"; exit 2; }
out="${OUT:-bundle/out}"; mkdir -p "$out"
rc=0
for i in $(seq 1 "$rounds"); do
  for b in ep-A ep; do
    log="$out/ab-$b-$i.log"
    timeout 300 "bundle/$b" bench "$@" >"$log" 2>&1 || rc=1
    echo "== $b (round $i)"
    grep -E "^ep bench: |\] (dispatch|combine) (BF16|FP8)|critical path|dispatch tail|^verified|MISMATCH|rror" "$log" \
      | sed -E 's/\[block 0 stamps[^]]*\]//g' | cut -c1-300
  done
done
exit $rc
