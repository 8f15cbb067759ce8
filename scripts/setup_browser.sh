#!/usr/bin/env bash
# Makes sure Debian's Chromium exists for the console's browser tests (tests/console), which Playwright for Python
# drives through executable_path=/usr/bin/chromium: Playwright's own browser download is never used (it would
# need a host other than the package registries). Idempotent: does nothing when /usr/bin/chromium is there.
set -euo pipefail

if [[ ! -x /usr/bin/chromium ]]; then
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  install_chromium() { $sudo apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core; }
  # Only refresh the package lists when the cached ones are not enough.
  if ! install_chromium; then
    $sudo apt-get update -q
    install_chromium
  fi
fi
[[ -x /usr/bin/chromium ]] || { echo "/usr/bin/chromium still missing after install" >&2; exit 1; }
/usr/bin/chromium --version 2>/dev/null
