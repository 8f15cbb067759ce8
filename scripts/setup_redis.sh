#!/usr/bin/env bash
# Makes sure Debian's redis-server, redis-sentinel and redis-cli exist for the Redis store's tests (standalone,
# Sentinel and Cluster set-ups are all built from them). Idempotent: does nothing if all three are on PATH.
# Tests start their own redis-server on a free loopback port with a temp data dir; they never use the package's
# service on 6379, so if installing started one it is left alone.
set -euo pipefail

missing() { for b in redis-server redis-sentinel redis-cli; do command -v "$b" >/dev/null 2>&1 || return 0; done; return 1; }
if missing; then
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  install_redis() { $sudo apt-get install -y -q --no-install-recommends redis-server redis-sentinel redis-tools; }
  # Only refresh the package lists when the cached ones are not enough.
  if ! install_redis; then
    $sudo apt-get update -q
    install_redis
  fi
fi
! missing || { echo "redis-server, redis-sentinel or redis-cli still not on PATH after install" >&2; exit 1; }
redis-server --version
