#!/usr/bin/env bash
# One bounded device call that verifies a bundle (scripts/gpu-bundle.sh) on the GPU machine and
# measures it, with a short table last. Usage, with the device tool:
#   run(command: "bash scripts/gpu-verify.sh [STEP...]", carry: ["bundle"])
# Steps (default: buffer normal bench): buffer = Buffer<Gpu> against Buffer<Sim>
# (ep-kernels--gpu_buffer, normal mode; ep-kernels--gpu_buffer_ll, low-latency mode on both
# kernel variants; buffer-normal / buffer-ll: either half alone; buffer-ll-nvshmem: variant (b) alone); normal = the NormalGroup suites (gpu_normal, gpu_normal_graph,
# gpu_normal_procs); ll = the low-latency suite (both kernel variants; ll-nvshmem: variant (b) alone); bench = `ep bench
# --backend gpu` R = 2 BF16 and FP8 and R = 8 (bench8: R = 8 alone), each with the canonical digest beside the
# simulator's for the same flags; mps = gpu_normal_procs and `ep bench --procs 2`, BF16 and FP8 (DeepEP's
# one-GPU configuration: 2 rank processes, 24 SMs each) under MPS, started for that step only;
# criterion = benches/gpu (the public API, host wall-clock); llbench = `ep bench --mode
# low-latency` at DeepEP's shape on variants (a) and (b), graphs, digest beside the simulator's;
# ab-normal / ab-normal8 / ab-ll (ab-args: the flags in $AB_ARGS) = the same benches from bundle/ep-A (an earlier build), bundle/ep-B
# (an intermediate build, when present) and bundle/ep, alternated
# AB_ROUNDS times (default 1: A B), for a change's A/B on one machine. Every step has its own time limit; the whole run stays within
# BUDGET seconds (default 540), and a step that would not fit is reported NOT RUN, never passed.
# Measured step times (H100, 2026-12-07), for sizing a call: one ab-normal / ab-args / ab-ll run
# 5-12 s, one ab-normal8 run 74 s, gpu_low_latency 114-136 s and its nvshmem half 85-117 s,
# gpu_buffer_ll (variant a) over 136 s, buffer-ll-nvshmem 115-123 s, normal-core-fast 163-186 s,
# normal-more 43-50 s; a machine's start adds 90-200 s of
# device time before the first step (once 480 s: held 842 s for a 362 s command), and a start that
# fails costs 90-180 s.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export EP_GPU_TESTS=1 RUST_BACKTRACE=1
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
out="${OUT:-bundle/out}"
mkdir -p "$out"
budget="${BUDGET:-540}"
start=$(date +%s)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(buffer normal bench)
table=()
left() { echo $((budget - ($(date +%s) - start))); }
# step name, limit seconds, command...
step() {
  local name="$1" limit="$2"; shift 2
  local l; l=$(left)
  if [ "$l" -lt 20 ]; then table+=("$name|NOT RUN (budget)|"); return; fi
  [ "$limit" -gt "$l" ] && limit=$l
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local secs=$(( $(date +%s) - t0 ))
  local res
  res=$(grep -E "^test result" "$out/$name.log" | tail -1 | sed 's/test result: //; s/; finished.*//')
  [ -z "$res" ] && res=$(grep -E "output digest|verified|time:" "$out/$name.log" | head -2 | tr '\n' ' ' | cut -c1-120)
  if [ $rc -eq 0 ]; then table+=("$name|ok ${secs}s|$res"); else
    table+=("$name|FAILED rc=$rc ${secs}s|$res")
    grep -E -A3 "panicked|FAILED|MISMATCH|Error|error" "$out/$name.log" | head -40
  fi
}
tests() { # executable name, limit [, step name [, test args...]]
  local t="bundle/tests/ep-kernels--$1" lim="$2" nm="${3:-$1}"
  shift 2; [ $# -gt 0 ] && shift
  if [ -x "$t" ]; then step "$nm" "$lim" "$t" --include-ignored --test-threads=1 --nocapture "$@"
  else table+=("$nm|MISSING|"); fi
}
buffer_ll() { # gpu_buffer_ll on both kernel variants
  tests gpu_buffer_ll 200
  buffer_ll_nvshmem
}
buffer_ll_nvshmem() { # gpu_buffer_ll on variant (b)
  export EP_LL_VARIANT=nvshmem; tests gpu_buffer_ll 200 gpu_buffer_ll-nvshmem; unset EP_LL_VARIANT
}
ll_nvshmem() { # gpu_low_latency on variant (b) (its three variant-(a)-only tests filtered)
  export EP_LL_VARIANT=nvshmem; tests gpu_low_latency 200 gpu_low_latency-nvshmem --skip variant_b_; unset EP_LL_VARIANT
}
digest_of() { grep -oE "output digest [0-9a-f]+" "$1" | head -1 | awk '{print $3}'; }
bench() { # name, flags...
  local name="$1"; shift
  step "$name" 150 bundle/ep bench --backend gpu "$@"
  local sms; sms=$(echo "$@" | grep -oE -- "--sms-sweep [0-9]+" | awk '{print $2}')
  local rest; rest=$(echo "$@" | sed -E 's/--sms-sweep [0-9,]+//; s/--gpu-iters [0-9]+//')
  # shellcheck disable=SC2086
  timeout 120 bundle/ep bench --backend sim --num-sms "$sms" --iters 1 $rest >"$out/$name-sim.log" 2>&1
  local g s; g=$(digest_of "$out/$name.log"); s=$(digest_of "$out/$name-sim.log")
  if [ -n "$g" ] && [ "$g" = "$s" ]; then table+=("$name digest|equal to sim|$g"); else
    table+=("$name digest|DIFFERENT or missing|gpu=$g sim=$s"); fi
}
llbench() { # name, flags... (low-latency mode, DeepEP's shape, verified through Buffer<Gpu>)
  local name="$1"; shift
  local shape="--mode low-latency --ranks 2 --tokens 128 --hidden 7168 --topk 8 --experts 288"
  # shellcheck disable=SC2086
  step "$name" 150 bundle/ep bench --backend gpu $shape --num-sms 64 --gpu-iters 1000 "$@"
  # shellcheck disable=SC2086
  timeout 120 bundle/ep bench --backend sim $shape --iters 1 >"$out/$name-sim.log" 2>&1
  local g s; g=$(digest_of "$out/$name.log"); s=$(digest_of "$out/$name-sim.log")
  if [ -n "$g" ] && [ "$g" = "$s" ]; then table+=("$name digest|equal to sim|$g"); else
    table+=("$name digest|DIFFERENT or missing|gpu=$g sim=$s"); fi
}
ab() { # name, ep bench flags... : bundle/ep-A (an earlier build), bundle/ep-B (an intermediate one,
  # when present) and bundle/ep alternated, AB_ROUNDS times
  local name="$1"; shift
  [ -x bundle/ep-A ] || { table+=("$name|NOT RUN (no bundle/ep-A)|"); return; }
  local builds=(ep-A); [ -x bundle/ep-B ] && builds+=(ep-B); builds+=(ep)
  for i in $(seq 1 "${AB_ROUNDS:-1}"); do
    for b in "${builds[@]}"; do
      step "$name-$b-$i" 150 "bundle/$b" bench --backend gpu "$@"
      echo "== $name $b (round $i)"
      grep -E "\] (dispatch|combine) (BF16|FP8)|^(dispatch|combine|both|floor) |^steady-rate floor|^against the|^rank spread|dispatch tail|^verified|MISMATCH" "$out/$name-$b-$i.log" \
        | sed -E 's/\[block 0 stamps[^]]*\]//g' | cut -c1-220 | head -16
    done
  done
}
nvidia-smi -L 2>&1 | sed 's/^/gpu: /'
for s in "${steps[@]}"; do
  case "$s" in
    buffer) tests gpu_buffer 240; buffer_ll ;;
    normal) tests gpu_normal 200; tests gpu_normal_graph 120; tests gpu_normal_procs 120 ;;
    normal-core) tests gpu_normal 200 ;;
    normal-core-fast) tests gpu_normal 240 gpu_normal --skip deepep_shape ;;
    normal-more) tests gpu_normal_graph 120; tests gpu_normal_procs 120 ;;
    ll) tests gpu_low_latency 240; ll_nvshmem ;;
    ll-nvshmem) ll_nvshmem ;;
    bench) bench bench-r2 --ranks 2 --sms-sweep 24,8,64
           bench bench-r2-fp8 --ranks 2 --sms-sweep 24,8,64 --fp8
           bench bench-r8 --ranks 8 --sms-sweep 16,8 --gpu-iters 20 ;;
    bench8) bench bench-r8 --ranks 8 --sms-sweep 16,8 --gpu-iters 20 ;;
    mps) export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
         mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
         if nvidia-cuda-mps-control -d; then
           tests gpu_normal_procs 120 gpu_normal_procs-mps
           step bench-procs2-mps 150 bundle/ep bench --backend gpu --procs 2 --ranks 2 --num-sms 24 --gpu-iters 20
           step bench-procs2-mps-fp8 150 bundle/ep bench --backend gpu --procs 2 --ranks 2 --num-sms 24 --gpu-iters 20 --fp8
           echo quit | nvidia-cuda-mps-control
         else table+=("mps|MPS did not start|"); fi
         unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    buffer-normal) tests gpu_buffer 240 ;;
    buffer-ll) buffer_ll ;;
    buffer-ll-nvshmem) buffer_ll_nvshmem ;;
    buffer-ll-absent) tests gpu_buffer_ll 60 gpu_buffer_ll-absent an_absent_rank ;;
    llbench) llbench bench-ll-a --graph; llbench bench-ll-b --variant nvshmem --graph ;;
    ab-normal) ab ab-r2 --ranks 2 --sms-sweep 24,8,64; ab ab-r2-fp8 --ranks 2 --sms-sweep 24,8,64 --fp8 ;;
    ab-args) # shellcheck disable=SC2086
             ab ab ${AB_ARGS:?AB_ARGS: the ep bench flags} ;;
    ab-normal8) ab ab-r8 --ranks 8 --sms-sweep 16,8 --gpu-iters 20 ;;
    ab-ll) ab ab-ll-a --mode low-latency --ranks 2 --tokens 128 --hidden 7168 --topk 8 --experts 288 --num-sms 64 --gpu-iters 1000 --graph
           ab ab-ll-b --mode low-latency --ranks 2 --tokens 128 --hidden 7168 --topk 8 --experts 288 --num-sms 64 --gpu-iters 1000 --graph --variant nvshmem ;;
    criterion) step criterion 120 bundle/benches/gpu --bench --warm-up-time 1 --measurement-time 3 ;;
    *) table+=("$s|unknown step|") ;;
  esac
done
for f in "$out"/bench-*.log "$out"/criterion.log; do
  case "$f" in *bench-ll-*) [ -f "$f" ] && { echo "== $(basename "$f")"; grep -E "^(dispatch|combine|both|floor|verified|transport)" "$f" | cut -c1-200 | head -14; }; continue ;; esac
  [ -f "$f" ] || continue
  case "$f" in *-sim.log) continue ;; esac
  echo "== $(basename "$f")"; grep -E "dispatch (BF16|FP8):|combine BF16:|verified|digest|time:" "$f" | cut -c1-200 | head -16
done
# The device tool brings back only a few files: the logs go back as one archive.
tar -C "$out" -czf /tmp/verify-logs.tgz . 2>/dev/null && rm -f "$out"/*.log && mv /tmp/verify-logs.tgz "$out/"
echo
printf '%-22s | %-22s | %s\n' step result detail
for row in "${table[@]}"; do IFS='|' read -r a b c <<<"$row"; printf '%-22s | %-22s | %s\n' "$a" "$b" "$c"; done
