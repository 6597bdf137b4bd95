#!/usr/bin/env bash
# Issue 13's run on the two-GPU machine (nvidia-h200-x2: 2x H200, NV18), one process per GPU:
# the whole GPU test suite (scripts/gpu-run.sh, unchanged), `ep doctor` and `--probe`, then the
# figures of issue 13's table with DeepEP's shapes (BASELINES.md): normal mode at every SM count
# DeepEP was measured at, BF16 and FP8 dispatch, combine, the sparse top-2 row; low-latency mode
# in both kernel variants with the hook halves. Usage, with the device tool:
#   run(command: "bash scripts/gpu-run-2gpu.sh", carry: ["bundle"], kind: "nvidia-h200-x2")
# Writes logs and JSON under $OUT (or bundle/out) and prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
out="${OUT:-bundle/out}"; mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $gpus"; [ "$gpus" -ge 2 ] || { echo "this script needs two GPUs (nvidia-h200-x2)"; exit 2; }
bash scripts/gpu-run.sh 2>&1 | tee "$out/gpu-run.txt" | tail -40
summary=()
for sms in 24 32 48 64 96; do
  for dt in --no-fp8 --fp8; do
    f="$out/normal-$sms$dt.json"
    bundle/ep bench --backend gpu --procs 2 --ranks 2 --tokens 4096 --hidden 7168 --topk 8 --experts 256 \
      --num-sms "$sms" $dt --gpu-iters 50 --json "$f" >"$f.txt" 2>&1
    summary+=("normal $sms SMs $dt: exit $? | $(grep -h 'dispatch\|combine' "$f.txt" | grep GB/s | tr '\n' ' ' | cut -c1-300)")
  done
done
# The sparse row: top-2 over 256 experts (an all-gather shortcut cannot pass it).
f="$out/normal-24-top2.json"
bundle/ep bench --backend gpu --procs 2 --ranks 2 --tokens 4096 --hidden 7168 --topk 2 --experts 256 \
  --num-sms 24 --no-fp8 --gpu-iters 50 --json "$f" >"$f.txt" 2>&1
summary+=("normal 24 SMs top-2: exit $?")
for v in pointers nvshmem; do
  f="$out/ll-$v.json"
  bundle/ep bench --backend gpu --mode low-latency --variant "$v" --procs 2 --ranks 2 --tokens 128 \
    --hidden 7168 --topk 8 --experts 288 --num-sms 64 --gpu-iters 1000 --json "$f" >"$f.txt" 2>&1
  summary+=("low-latency variant $v: exit $? | $(grep -hE '^\[rank 0 out\] (dispatch|combine|hook|against the floor)' "$f.txt" | tr '\n' ' ' | cut -c1-300)")
done
printf '%s\n' "${summary[@]}"
