#!/usr/bin/env bash
# Builds an A/B for the GPU machine from commits, each in a git worktree of its own, so that
# builds measured against each other need no checkout of this tree (prepared changes live on main
# as a commit and its revert: their commits stay buildable):
#   bash scripts/gpu-ab-builds.sh REV [A_REV [B_REV]]
# bundle/ = REV's bundle (its scripts/gpu-bundle.sh), bundle/ep-A and bundle/ep-B = the `ep`
# binaries of A_REV and B_REV; then gpu-verify.sh's ab-* steps alternate ep-A, ep-B and ep, and
# its test steps run REV's tests. REV may be `.`: this tree as it is (uncommitted changes too).
# EP_AB_TESTS (default "gpu_low_latency gpu_buffer_ll") names the test executables kept in
# bundle/tests (ep-kernels--NAME); the rest, the benches and the examples are dropped, so the
# bundle stays under the device tool's 64 MiB carry. Every build requires the kernels
# (EP_REQUIRE_KERNELS=1: nvcc from this tree's .venv-cuda, GPU.md) and shares this tree's target
# directory, so only the workspace's own crates are rebuilt per commit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
[ $# -ge 1 ] && [ $# -le 3 ] || { sed -n 2,13p "$0" >&2; exit 2; }
[ -d .venv-cuda ] || { echo "no .venv-cuda here: install nvcc first (GPU.md)" >&2; exit 1; }
export EP_REQUIRE_KERNELS=1 CARGO_TARGET_DIR="$root/target"
keep="${EP_AB_TESTS:-gpu_low_latency gpu_buffer_ll}"
work=$(mktemp -d /tmp/ep-ab.XXXXXX)
trees=()
cleanup() {
  for t in "${trees[@]}"; do git -C "$root" worktree remove --force "$t" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# dir = a worktree of rev (this tree for `.`), with this tree's .venv-cuda.
tree_of() {
  local rev=$1
  if [ "$rev" = . ]; then dir=$root; return; fi
  dir="$work/$(git rev-parse --short "$rev^{commit}")"
  [ -d "$dir" ] && return
  git worktree add --detach "$dir" "$rev" >/dev/null
  trees+=("$dir")
  ln -s "$root/.venv-cuda" "$dir/.venv-cuda"
}
# Everything of `bundle` is built first into $work, since gpu-bundle.sh starts by removing bundle/.
names=(ep-A ep-B)
for i in $(seq 2 $#); do
  rev=${!i} name=${names[i - 2]}
  tree_of "$rev"
  echo "== $name: $rev"
  (cd "$dir" && cargo build --release -p ep-cli 2>&1 | tail -1)
  cp "$CARGO_TARGET_DIR/release/ep" "$work/$name"
done
tree_of "$1"
echo "== bundle: $1"
(cd "$dir" && bash scripts/gpu-bundle.sh | tail -2)
if [ "$dir" != "$root" ]; then rm -rf bundle && mv "$dir/bundle" bundle; fi
rm -rf bundle/benches bundle/examples
for t in bundle/tests/*; do
  n=${t#bundle/tests/ep-kernels--}
  case " $keep " in *" $n "*) ;; *) rm -f "$t" ;; esac
done
for name in ep-A ep-B; do [ -f "$work/$name" ] && cp "$work/$name" "bundle/$name"; done
ls -l bundle bundle/tests
du -sh bundle
