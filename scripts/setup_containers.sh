#!/usr/bin/env bash
# Installs what `make image` and the image test need: Debian's podman, buildah, mmdebstrap and runc.
# No image registry is reachable from these machines, so the base image is built from Debian's packages
# (scripts/build_image.sh) rather than pulled. Idempotent: does nothing when every tool is on PATH.
set -euo pipefail

need=()
for tool in podman buildah mmdebstrap runc; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
if ((${#need[@]})); then
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  # uidmap: rootless podman/buildah need newuidmap; fuse-overlayfs: overlay storage where the kernel's is refused.
  packages=(podman buildah mmdebstrap runc uidmap fuse-overlayfs)
  install() { $sudo apt-get install -y -q --no-install-recommends "${packages[@]}"; }
  # Only refresh the package lists when the cached ones are not enough.
  if ! install; then
    $sudo apt-get update -q
    install
  fi
fi
for tool in podman buildah mmdebstrap runc; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool still not on PATH after install" >&2; exit 1; }
done
