#!/usr/bin/env bash
# Builds the gateway's image (Containerfile) on a machine that reaches package registries but no image registry.
#
#   scripts/build_image.sh            # prints the image reference on its last line
#   FORCE=1 scripts/build_image.sh    # rebuild even when the image is current
#   scripts/build_image.sh --base-only  # only the base; prints its reference
#
# 1. The base: Debian bookworm (minbase, python3, python3-venv) from Debian's own packages by mmdebstrap, cached
#    as a tarball under .cache/image/ (built once, ~1 min) and imported as localhost/debian-base:bookworm.
# 2. The image: `buildah bud --isolation chroot` (podman's own build fails on hosts whose cgroups crun cannot
#    handle), tagged localhost/llm-gateway:<version>, labelled with a hash of every build input so that an image
#    that is already current is reused instead of rebuilt. No intermediate layers are kept (pip's cache mount
#    makes a rebuild quick without them), and the image a rebuild replaces is removed: no pile of old layers.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

base_ref=localhost/debian-base:bookworm
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
image_ref=${IMAGE:-localhost/llm-gateway:$version}
cache=$root/.cache/image
mkdir -p "$cache"

# What the base is made of; a change to it makes a new tarball.
debian_suite=bookworm
base_packages=python3,python3-venv
dpkg_opts=(
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
  --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*'
  --dpkgopt='path-exclude=/usr/share/info/*'
)
base_key=$(printf '%s\n' "$debian_suite" "$base_packages" "${dpkg_opts[@]}" | sha256sum | cut -c1-16)
base_tar=$cache/debian-$debian_suite-$base_key.tar

if [[ ! -s $base_tar ]]; then
  echo "building the base from Debian's packages: $base_tar" >&2
  mmdebstrap --quiet --format=tar --variant=minbase --include="$base_packages" "${dpkg_opts[@]}" \
    "$debian_suite" "$base_tar.part"
  mv "$base_tar.part" "$base_tar"
fi
# The imported base carries the tarball's key, so a new tarball is imported again.
if [[ $(podman image inspect --format '{{index .Config.Labels "llm-gateway.base-key"}}' "$base_ref" 2>/dev/null) \
      != "$base_key" ]]; then
  echo "importing $base_ref" >&2
  podman import --quiet --change "LABEL llm-gateway.base-key=$base_key" --change 'CMD ["/bin/bash"]' \
    "$base_tar" "$base_ref" >/dev/null
fi

if [[ ${1:-} == --base-only ]]; then
  echo "$base_ref"
  exit 0
fi

# Every input of the build, hashed: the image is current when its label says the same.
inputs=$( (printf '%s\n' "$base_key"; find Containerfile .containerignore pyproject.toml README.md gateway policies backends tools \
            -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) \
          | sha256sum | cut -c1-16)
current=$(podman image inspect --format '{{index .Config.Labels "llm-gateway.inputs"}}' "$image_ref" 2>/dev/null || true)
if [[ $current == "$inputs" && -z ${FORCE:-} ]]; then
  echo "$image_ref is current (inputs $inputs)" >&2
  echo "$image_ref"
  exit 0
fi

secret=()
# Behind a TLS-intercepting proxy pip must trust what this machine trusts: the bundle is a build secret,
# mounted for the pip steps only, never part of a layer.
ca_bundle=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [[ -s $ca_bundle ]]; then secret=(--secret "id=pip-ca,src=$ca_bundle"); fi

echo "building $image_ref (inputs $inputs)" >&2
previous=$(podman image inspect --format '{{.Id}}' "$image_ref" 2>/dev/null || true)
start=$SECONDS
buildah bud --isolation chroot --quiet "${secret[@]}" \
  --build-arg "VERSION=$version" --label "llm-gateway.inputs=$inputs" \
  -f Containerfile -t "$image_ref" . >/dev/null
echo "built $image_ref in $((SECONDS - start)) s" >&2
if [[ -n $previous && $previous != $(podman image inspect --format '{{.Id}}' "$image_ref") ]]; then
  podman rmi "$previous" >/dev/null 2>&1 || true  # still used by a container: left for its owner
fi
echo "$image_ref"
