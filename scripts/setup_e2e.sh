#!/usr/bin/env bash
# Prepares everything the end-to-end tests need, offline: the vLLM venv, the tiny model it serves and the
# LoRA adapters built for that model.
# Idempotent: both steps leave a finished result alone, so a second run takes seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VLLM_VENV:-$root/.venv-vllm}
model_dir=${TINY_MODEL_DIR:-$root/.cache/models/tiny}

bash "$root/scripts/setup_vllm.sh"
"$venv/bin/python" "$root/scripts/build_tiny_model.py" --out "$model_dir"
"$venv/bin/python" "$root/scripts/build_lora_adapters.py" --model "$model_dir"
