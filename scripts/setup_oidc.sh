#!/usr/bin/env bash
# node-oidc-provider (npm, pinned) in .cache/oidc, for the admin API's OIDC tests (tests/oidc/provider.mjs).
# Idempotent and offline-safe once installed: does nothing when the pinned version is already there.
# Needs node (>= 20.19) and npm on PATH; without them the OIDC tests are skipped with the reason.
set -euo pipefail

VERSION=9.13.3
DIR=.cache/oidc
have() { [[ -f $DIR/node_modules/oidc-provider/package.json ]] &&
  grep -q "\"version\": \"$VERSION\"" "$DIR/node_modules/oidc-provider/package.json"; }
if ! command -v npm >/dev/null 2>&1; then
  echo "setup_oidc: npm not found; the OIDC tests will be skipped" >&2
  exit 0
fi
if ! have; then
  mkdir -p "$DIR"
  [[ -f $DIR/package.json ]] || echo '{"name": "llm-gateway-oidc-tests", "private": true}' > "$DIR/package.json"
  npm install --prefix "$DIR" --no-audit --no-fund --save-exact "oidc-provider@$VERSION"
fi
have || { echo "oidc-provider $VERSION still missing from $DIR after install" >&2; exit 1; }
echo "oidc-provider $VERSION in $DIR"
