#!/usr/bin/env bash
# Builds, on the development machine, the release test executables and examples that need a GPU
# (ep-kernels, nvshmem-sys, ibgda-sys) and the `ep` binary, and collects them in bundle/ (git-ignored) for the GPU
# machine, which has no Rust toolchain. Every test executable of those crates is collected, the
# self-spawning ones included (ep-kernels--gpu_normal_procs, ep-kernels--nvshmem_bringup start
# copies of themselves as rank processes). Then, with the device tool:
#   run(command: "bash scripts/gpu-run.sh", carry: ["bundle"], kind: "nvidia-h200-x2")
# and, to compare with an earlier build copied to bundle/ep-A: bash scripts/gpu-ab.sh (its header).
# nvcc must be reachable at build time for the kernels (see GPU.md: the pip toolchain in
# .venv-cuda is found automatically).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
crates=(-p ep-kernels -p nvshmem-sys -p ibgda-sys)
rm -rf bundle && mkdir -p bundle/tests bundle/examples
json=$(mktemp)
cargo test --release "${crates[@]}" --no-run --message-format=json >"$json"
cargo build --release -p ep-kernels --examples --message-format=json >>"$json"
python3 - "$json" <<'PY'
import json, shutil, sys, os
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    kind = t["kind"][0]
    crate = m["package_id"].split("#")[0].rstrip("/").split("/")[-1].split("@")[0]
    if kind == "example":
        dest = f"bundle/examples/{t['name']}"
    elif kind in ("test", "lib"):
        dest = f"bundle/tests/{crate}--{t['name']}"
    else:
        continue
    if dest in seen:
        continue
    seen.add(dest)
    shutil.copy2(m["executable"], dest)
    print(f"{dest}  ({os.path.getsize(dest) >> 10} KiB)")
PY
rm -f "$json"
# The `ep` binary itself: `ep doctor` (live probes) and, later, `ep bench --backend gpu`.
cargo build --release -p ep-cli
cp "$CARGO_TARGET_DIR/release/ep" bundle/ep
# The criterion bench over the GPU API (benches/gpu.rs): bundle/benches/gpu --bench there.
mkdir -p bundle/benches
cargo bench --no-run --bench gpu --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        shutil.copy2(m["executable"], "bundle/benches/gpu")
        print("bundle/benches/gpu")
'
if ! grep -q "Some(" "$(ls -t "$CARGO_TARGET_DIR"/release/build/ep-kernels-*/out/kernels.rs | head -1)"; then
  echo "WARNING: ep-kernels was built without nvcc: the GPU tests will fail (see GPU.md)" >&2
fi
du -sh bundle
