#!/usr/bin/env bash
# Captures what `ep doctor` reads from this machine into a small fixture tree, so its verdicts
# can be replayed anywhere with `ep doctor --sysroot DEST` (and tested in CI).
#
#   scripts/capture-sysroot.sh DEST [NVSHMEM_LIB_DIR]
#
# Copied: NVIDIA driver version/params, /proc/modules, /proc/devices, /proc/cmdline, the
# kernel release, this shell's limits, os-release, modprobe and ld.so configuration, sysfs of
# NVIDIA GPUs, RDMA NICs and the PCI bridges above them (attribute files, symlinks kept
# relative), RDMA ports and GID tables, IOMMU group names, device node names (as empty files),
# the names of the libraries doctor looks for (as empty files), NVSHMEM's directory listing
# with its version header, and `nvidia-smi topo -m`.
# Not copied: anything secret. No environment of any process is copied (only whether PID 1
# has a `container=` variable), only the IOMMU/PCI/nvidia words of the kernel command line, no
# file contents beyond the attribute files listed above.
set -u -o pipefail

DEST=${1:?usage: capture-sysroot.sh DEST [NVSHMEM_LIB_DIR]}
NVSHMEM_LIB=${2:-}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

copy() { # copy FILE...: copy readable regular files to the same path under DEST
  local f
  for f in "$@"; do
    [ -f "$f" ] && [ -r "$f" ] || continue
    mkdir -p "$DEST$(dirname "$f")"
    cat "$f" > "$DEST$f" 2>/dev/null || rm -f "$DEST$f"
  done
}
touch_as() { # touch_as PATH...: an empty regular file standing for PATH
  local f
  for f in "$@"; do
    mkdir -p "$DEST$(dirname "$f")"
    : > "$DEST$f"
  done
}
link_as() { # link_as PATH: the same (relative) symlink under DEST
  local f=$1 t
  t=$(readlink "$f") || return 0
  mkdir -p "$DEST$(dirname "$f")"
  ln -sfn "$t" "$DEST$f"
}

# ---- /proc, /etc ----------------------------------------------------------------------------
copy /proc/driver/nvidia/version /proc/driver/nvidia/params /proc/modules /proc/devices \
     /proc/sys/kernel/osrelease
# Only the kernel parameters doctor reads (IOMMU, PCI, nvidia.*): the rest can name hosts,
# ports or boot secrets.
mkdir -p "$DEST/proc"
tr ' ' '\n' < /proc/cmdline | grep -E '^(iommu|intel_iommu|amd_iommu|iommu\.|nvidia\.|pci=)' \
  | tr '\n' ' ' | sed 's/ $//' > "$DEST/proc/cmdline"
echo >> "$DEST/proc/cmdline"
mkdir -p "$DEST/proc/self"
cat /proc/self/limits > "$DEST/proc/self/limits"
copy /etc/os-release /usr/lib/os-release /etc/ld.so.conf
copy /etc/ld.so.conf.d/*.conf
for d in /etc/modprobe.d /run/modprobe.d /usr/local/lib/modprobe.d /lib/modprobe.d; do
  copy "$d"/*.conf
done
[ -e /.dockerenv ] && touch_as /.dockerenv
[ -e /run/.containerenv ] && touch_as /run/.containerenv
if tr '\0' '\n' 2>/dev/null < /proc/1/environ | grep -q '^container='; then
  mkdir -p "$DEST/proc/1"
  printf 'container=%s\0' "$(tr '\0' '\n' < /proc/1/environ | sed -n 's/^container=//p' | head -1)" \
    > "$DEST/proc/1/environ"
fi
grep -E 'docker|kubepods|containerd|lxc|libpod' /proc/1/cgroup >/dev/null 2>&1 && copy /proc/1/cgroup

# ---- /sys/module --------------------------------------------------------------------------------
copy /sys/module/nvidia/version /sys/module/nvidia/taint
for m in nvidia nvidia_peermem nv_peer_mem gdrdrv mlx5_core mlx5_ib ib_uverbs ib_core; do
  copy "/sys/module/$m/initstate"
done

# ---- PCI: GPUs, NICs and the bridges above them -------------------------------------------------
pci_attrs() { # pci_attrs REALDIR
  local d=$1
  copy "$d/vendor" "$d/device" "$d/class" "$d/numa_node" "$d/uevent"
  [ -L "$d/iommu_group" ] && link_as "$d/iommu_group"
}
for dev in /sys/bus/pci/devices/*; do
  [ -e "$dev" ] || continue
  vendor=$(cat "$dev/vendor" 2>/dev/null); class=$(cat "$dev/class" 2>/dev/null)
  case "$vendor:$class" in
    0x10de:0x0300*|0x10de:0x0302*|*:0x0200*|*:0x0207*) ;;
    *) continue ;;
  esac
  link_as "$dev"
  real=$(readlink -f "$dev")
  pci_attrs "$real"
  # bridges between the root complex and the device
  p=$(dirname "$real")
  while [[ "${p##*/}" =~ ^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9]$ ]]; do
    b=${p##*/}
    if [ -e "/sys/bus/pci/devices/$b" ]; then
      link_as "/sys/bus/pci/devices/$b"
      pci_attrs "$p"
      # ACS lives in extended config space: readable in full only by root.
      if [ "$(stat -c %s "$p/config" 2>/dev/null || echo 0)" -gt 256 ] && \
         [ "$(head -c 4096 "$p/config" 2>/dev/null | wc -c)" -gt 256 ]; then
        mkdir -p "$DEST$p"; head -c 4096 "$p/config" > "$DEST$p/config"
      fi
    fi
    p=$(dirname "$p")
  done
  # network interface names of NICs
  if [ -d "$real/net" ]; then
    for n in "$real"/net/*; do [ -e "$n" ] && copy "$n/operstate"; done
  fi
done
for g in /sys/kernel/iommu_groups/*; do
  [ -d "$g" ] && copy "$g/type" && mkdir -p "$DEST$g"
done

# ---- RDMA ---------------------------------------------------------------------------------------
for ib in /sys/class/infiniband/*; do
  [ -e "$ib" ] || continue
  link_as "$ib"
  real=$(readlink -f "$ib")
  [ -L "$real/device" ] && link_as "$real/device"
  for port in "$real"/ports/*; do
    copy "$port/state" "$port/phys_state" "$port/link_layer" "$port/rate"
    for g in "$port"/gids/*; do copy "$g"; done
    for g in "$port"/gid_attrs/types/*; do copy "$g"; done
    for g in "$port"/gid_attrs/ndevs/*; do copy "$g"; done
  done
done
for u in /sys/class/infiniband_verbs/*; do copy "$u/ibdev"; done

# ---- /dev ---------------------------------------------------------------------------------------
for n in /dev/nvidia* /dev/infiniband/* /dev/gdrdrv; do
  [ -e "$n" ] && [ ! -d "$n" ] && touch_as "$n"
done

# ---- libraries (names only) -----------------------------------------------------------------------
libdirs="/lib /lib64 /usr/lib /usr/lib64 /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu \
  /lib/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/local/lib /usr/local/cuda/lib64 \
  /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/targets/sbsa-linux/lib"
libdirs="$libdirs $(cat /etc/ld.so.conf.d/*.conf 2>/dev/null | grep '^/' | tr '\n' ' ')"
for d in $libdirs; do
  for f in "$d"/libibverbs.so* "$d"/libmlx5.so* "$d"/libgdrapi.so* "$d"/libnvJitLink.so*; do
    [ -e "$f" ] && touch_as "$f"
  done
done

# ---- NVSHMEM --------------------------------------------------------------------------------------
if [ -z "$NVSHMEM_LIB" ]; then
  for c in ${NVSHMEM_DIR:+$NVSHMEM_DIR/lib} ${NVSHMEM_HOME:+$NVSHMEM_HOME/lib} \
           /opt/*/.venv/lib/python3*/site-packages/nvidia/nvshmem/lib \
           /usr/local/lib/python3*/dist-packages/nvidia/nvshmem/lib \
           /usr/lib/x86_64-linux-gnu/nvshmem/13 /usr/lib/x86_64-linux-gnu/nvshmem/12; do
    if ls "$c"/libnvshmem_host.so* >/dev/null 2>&1; then NVSHMEM_LIB=$c; break; fi
  done
fi
if [ -n "$NVSHMEM_LIB" ] && [ -d "$NVSHMEM_LIB" ]; then
  NVSHMEM_LIB=$(cd "$NVSHMEM_LIB" && pwd)
  for f in "$NVSHMEM_LIB"/*; do [ -f "$f" ] && touch_as "$f"; done
  root=$(dirname "$NVSHMEM_LIB")
  copy "$root/include/non_abi/nvshmem_version.h" "$root/include/nvshmem_version.h"
  site=$(dirname "$(dirname "$root")")
  for di in "$site"/nvidia_nvshmem*.dist-info; do
    [ -d "$di" ] && mkdir -p "$DEST$di" && head -3 "$di/METADATA" > "$DEST$di/METADATA" 2>/dev/null
  done
fi

# ---- nvidia-smi ---------------------------------------------------------------------------------
mkdir -p "$DEST/ep-doctor"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi topo -m > "$DEST/ep-doctor/nvidia-smi-topo-m.txt" 2>/dev/null || \
    rm -f "$DEST/ep-doctor/nvidia-smi-topo-m.txt"
fi
{
  echo "captured $(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/capture-sysroot.sh"
  echo "kernel $(uname -r)"
  [ -n "$NVSHMEM_LIB" ] && echo "nvshmem $NVSHMEM_LIB"
} > "$DEST/ep-doctor/CAPTURED"
echo "captured into $DEST ($(find "$DEST" | wc -l) entries, $(du -sh --apparent-size "$DEST" | cut -f1))"
