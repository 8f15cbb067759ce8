#!/usr/bin/env bash
# Makes sure a redis-server binary exists for the Redis store's tests. Idempotent: does nothing if one is on PATH.
# Tests start their own redis-server on a free loopback port with a temp data dir; they never use the package's
# service on 6379, so if installing started one it is left alone.
set -euo pipefail

if ! command -v redis-server >/dev/null 2>&1; then
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  install_redis() { $sudo apt-get install -y -q --no-install-recommends redis-server; }
  # Only refresh the package lists when the cached ones are not enough.
  if ! install_redis; then
    $sudo apt-get update -q
    install_redis
  fi
fi
command -v redis-server >/dev/null 2>&1 || { echo "redis-server still not on PATH after install" >&2; exit 1; }
redis-server --version
