#!/usr/bin/env python3
"""Build small LoRA adapters for the tiny test model (scripts/build_tiny_model.py), fully offline.

Run it with the vLLM venv's python (it needs torch and safetensors, which vLLM brings):

    .venv-vllm/bin/python scripts/build_lora_adapters.py [--model DIR] [--out DIR] [--force]

What it writes (default DIR: <repo>/.cache/models/tiny-loras), one directory per adapter (ADAPTERS below):
- adapter_config.json: peft's LORA config (r, lora_alpha, target_modules q_proj, v_proj, o_proj), which is all
  vLLM reads of it;
- adapter_model.safetensors: `base_model.model.model.layers.{i}.self_attn.{q,v,o}_proj.lora_{A,B}.weight`
  (A: [r, in], B: [out, r]) with random, seeded, non-zero weights large enough that greedy decoding of the
  same prompt gives a different answer with each adapter and without one.

Written directly rather than with `peft`: the format is two files, vLLM (not peft) reads them, and peft is not
in the vLLM venv (another pinned package to install for the sake of one `save_pretrained`).

Seeded, so the same library versions give the same files. Built in a temporary directory and renamed into
place, so DIR is complete (it holds the stamp) or absent; a complete DIR is left alone unless --force.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

FORMAT = 1  # bump when the adapters change: a stamp of another format rebuilds them
STAMP = ".lora-adapters-complete"
RANK = 8
# name -> seed; each adapter's weights differ, so does its answer
ADAPTERS = {"tiny-lora-a": 101, "tiny-lora-b": 202, "tiny-lora-c": 303}
TARGETS = ("q_proj", "v_proj", "o_proj")


def default_model_dir() -> Path:
    return Path(__file__).resolve().parent.parent / ".cache" / "models" / "tiny"


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim),
            "o_proj": (heads * head_dim, hidden)}


def build_one(out: Path, config: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (n_in, n_out) in shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            # both factors non-zero (peft starts B at zero, which would leave the base's answer unchanged)
            a = torch.randn(RANK, n_in, generator=generator) * 0.5
            b = torch.randn(n_out, RANK, generator=generator) * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(TARGETS), "base_model_name_or_path": "tiny",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=default_model_dir(), help="the base model's directory")
    parser.add_argument("--out", type=Path, default=None, help="where the adapters go (default: MODEL-loras)")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args()
    out: Path = args.out or args.model.with_name(args.model.name + "-loras")
    stamp = out / STAMP
    if stamp.is_file() and not args.force:
        try:
            if json.loads(stamp.read_text()).get("format") == FORMAT:
                print(f"LoRA adapters ready: {out} (stamp {stamp.name} present)")
                return 0
        except ValueError:
            pass
    config = json.loads((args.model / "config.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a vLLM run by another user (a container) reads it
    try:
        for name, seed in ADAPTERS.items():
            build_one(tmp / name, config, seed)
        (tmp / STAMP).write_text(json.dumps({"format": FORMAT, "rank": RANK, "adapters": sorted(ADAPTERS)}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"LoRA adapters built: {out} ({', '.join(ADAPTERS)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
