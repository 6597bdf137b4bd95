#!/usr/bin/env bash
# Runs, on the GPU machine, the executables scripts/gpu-bundle.sh collected, with hardware tests
# enabled. Usage: bash scripts/gpu-run.sh [test-name-filter ...]
# Logs go to $OUT (the device tool's folder) or bundle/out, plus a summary line
# "N passed, N failed".
# GPU_RUN_ONLY=<glob>: only the test executables whose name matches (e.g. '*gpu_normal_procs'),
#   no examples, doctor or bench.
# GPU_RUN_MPS=1: the multi-process normal-mode tests (ep-kernels--gpu_normal_procs) and `ep bench --procs 2` run once more
#   under MPS, started for that run only and stopped right after it (GPU.md).
set -uo pipefail
cd "$(dirname "$0")/.."
# Never NVLink multicast / SHArP on the shared machine (GPU.md).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export EP_GPU_TESTS=1 RUST_BACKTRACE=1
# The machine's NVSHMEM comes with PyTorch's venv: put its Python on PATH so the loader's pip
# search finds it (no NVSHMEM_DIR needed); the nvshmem-sys real-library test gets the file.
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
nv=$(ls /opt/torch/.venv/lib/python3*/site-packages/nvidia/nvshmem/lib/libnvshmem_host.so.3 2>/dev/null | head -1)
[ -n "$nv" ] && export EP_TEST_NVSHMEM_LIB="$nv"
out="${OUT:-bundle/out}"
mkdir -p "$out"
nvidia-smi -L 2>&1 | sed 's/^/gpu: /'
pass=0; fail=0
# Ignored tests whose requirement this machine lacks are skipped here, by name, and reported as
# skipped (run, they would fail naming what is missing; they never pass untouched).
skip=(); skipped=""
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  skip+=(--skip list_devices_where_rdma_core_is_installed)
  skipped="list_devices_where_rdma_core_is_installed (no libibverbs.so.1)"
  echo "SKIPPED: $skipped"
fi
only="${GPU_RUN_ONLY:-}"
for ex in bundle/examples/*; do
  [ -x "$ex" ] || continue
  [ -z "$only" ] || continue
  echo "=== example $(basename "$ex")"
  timeout 60 "$ex" 2>&1 | tee "$out/example-$(basename "$ex").log"
done
run_test() { # executable, log name, test args...
  local t="$1" name="$2"; shift 2
  echo "=== $name"
  timeout 300 "$t" --include-ignored --test-threads=1 --nocapture "${skip[@]}" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  grep -E "^test |SKIPPED|RANK|phase|transports|ibgda|NVSHMEM|init took|env |panicked|FAILED|test result" "$out/$name.log" | head -80
  if [ $rc -eq 0 ]; then pass=$((pass+1)); else fail=$((fail+1)); echo "$name exited $rc"; tail -40 "$out/$name.log"; fi
}
for t in bundle/tests/*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  # shellcheck disable=SC2053 # $only is a glob
  [ -z "$only" ] || [[ $name == $only ]] || continue
  run_test "$t" "$name" "$@"
  # The low-latency suites once more on kernel variant (b), NVSHMEM's device API (one PE).
  if [ "$name" = ep-kernels--gpu_low_latency ] || [ "$name" = ep-kernels--gpu_buffer_ll ]; then
    export EP_LL_VARIANT=nvshmem; run_test "$t" "$name-nvshmem" --skip variant_b_ "$@"; unset EP_LL_VARIANT
  fi
done
procs=bundle/tests/ep-kernels--gpu_normal_procs
if [ "${GPU_RUN_MPS:-0}" = 1 ] && [ -x "$procs" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    run_test "$procs" "$(basename "$procs")-mps" "$@"
    if [ -x bundle/ep ]; then
      # ep-rs in DeepEP's one-GPU baseline configuration: 2 rank processes under MPS, 24 SMs each.
      echo "=== ep bench --backend gpu --procs 2 (MPS)"
      bundle/ep bench --backend gpu --procs 2 --ranks 2 --num-sms 24 --gpu-iters 20 \
        --json "$out/bench-gpu-procs2-mps.json" 2>&1 | tee "$out/bench-gpu-procs2-mps.txt" | grep -vE "phases"
      echo "ep bench --procs 2 (MPS) exited ${PIPESTATUS[0]}"
      # Low-latency mode one rank per process, both kernel variants (NVSHMEM, one PE per rank).
      for v in nvshmem pointers; do
        echo "=== ep bench --backend gpu --mode low-latency --variant $v --procs 2 (MPS)"
        bundle/ep bench --backend gpu --mode low-latency --variant $v --procs 2 --ranks 2 --tokens 128 \
          --hidden 7168 --topk 8 --experts 288 --num-sms 64 --gpu-iters 1000 \
          --json "$out/bench-gpu-ll-procs2-$v-mps.json" 2>&1 | tee "$out/bench-gpu-ll-procs2-$v-mps.txt"
        echo "ep bench --mode low-latency --variant $v --procs 2 (MPS) exited ${PIPESTATUS[0]}"
      done
    fi
    echo quit | nvidia-cuda-mps-control; trap - EXIT
  else
    echo "MPS did not start: the MPS run of $procs is skipped"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
[ -n "$only" ] && { echo "$pass passed, $fail failed${skipped:+; skipped: $skipped}"; [ $fail -eq 0 ]; exit; }
if [ -x bundle/ep ]; then
  # The doctor for real: live probes (CUDA, rdma-core, GDRCopy), then --probe (NVSHMEM started
  # in two child processes with the plan's environment; GPU-memory registration with a NIC).
  echo "=== ep doctor"
  bundle/ep doctor 2>&1 | tee "$out/doctor.txt"; echo "ep doctor exited ${PIPESTATUS[0]}"
  echo "=== ep doctor --probe --json"
  bundle/ep doctor --probe --json >"$out/doctor-probe.json" 2>"$out/doctor-probe.stderr"
  echo "ep doctor --probe exited $?"
  bundle/ep doctor --probe 2>&1 | grep -E "probe|capabilit|PASS  |FAIL  |WARN  " | tail -30
fi
if [ -x bundle/ep ]; then
  # The GPU benchmark (normal mode, co-resident ranks), JSON beside the logs.
  echo "=== ep bench --backend gpu"
  bundle/ep bench --backend gpu --ranks 2 --sms-sweep 8,24,64 --gpu-iters 20 --json "$out/bench-gpu-r2.json" 2>&1 \
    | tee "$out/bench-gpu-r2.txt" | grep -vE "phases"
  echo "ep bench --backend gpu exited ${PIPESTATUS[0]}"
  # Low-latency mode (variant a, co-resident ranks), issue 12's shape: FP8 dispatch.
  # --graph: the same calls replayed from CUDA graphs too.
  echo "=== ep bench --backend gpu --mode low-latency"
  bundle/ep bench --backend gpu --mode low-latency --ranks 2 --tokens 128 --hidden 7168 --topk 8 \
    --experts 288 --num-sms 64 --gpu-iters 1000 --graph --json "$out/bench-gpu-ll-r2.json" 2>&1 \
    | tee "$out/bench-gpu-ll-r2.txt"
  echo "ep bench --backend gpu --mode low-latency exited ${PIPESTATUS[0]}"
  echo "=== ep bench --backend gpu --mode low-latency --variant nvshmem"
  bundle/ep bench --backend gpu --mode low-latency --variant nvshmem --ranks 2 --tokens 128 --hidden 7168 \
    --topk 8 --experts 288 --num-sms 64 --gpu-iters 1000 --graph --json "$out/bench-gpu-ll-r2-nvshmem.json" 2>&1 \
    | tee "$out/bench-gpu-ll-r2-nvshmem.txt"
  echo "ep bench --backend gpu --mode low-latency --variant nvshmem exited ${PIPESTATUS[0]}"
  echo "=== ep bench --backend gpu --mode low-latency --logfmt"
  bundle/ep bench --backend gpu --mode low-latency --logfmt --ranks 2 --tokens 128 --hidden 7168 --topk 8 \
    --experts 288 --num-sms 64 --gpu-iters 1000 --json "$out/bench-gpu-ll-r2-logfmt.json" 2>&1 \
    | tee "$out/bench-gpu-ll-r2-logfmt.txt"
  echo "ep bench --backend gpu --mode low-latency --logfmt exited ${PIPESTATUS[0]}"
fi
if [ -x bundle/benches/gpu ]; then
  # The criterion bench over the public GPU API (benches/gpu.rs; host wall-clock per call).
  echo "=== cargo bench --bench gpu (bundle/benches/gpu)"
  bundle/benches/gpu --bench --warm-up-time 1 --measurement-time 3 2>&1 | tee "$out/bench-criterion-gpu.txt" \
    | grep -E "skipped|time:|thrpt:|^gpu_normal" | head -20
  echo "benches/gpu exited ${PIPESTATUS[0]}"
fi
echo "$pass passed, $fail failed${skipped:+; skipped: $skipped}"
[ $fail -eq 0 ]
