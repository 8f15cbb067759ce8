"""Run one simulated vLLM server: python -m tools.simulator --port 8001 --model NAME [--preset reference-gpu]."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

import uvicorn

from .app import create_app
from .config import SimConfig

PRESETS: dict[str, Callable[[], SimConfig]] = {"default": SimConfig, "reference-gpu": SimConfig.reference_gpu}
# Flags that map one-to-one onto SimConfig fields (vLLM's own names where vLLM has the setting).
FIELD_FLAGS = ("max_model_len", "max_num_seqs", "step_base_ms", "step_ms_per_seq", "prefill_base_ms",
               "prefill_ms_per_token", "default_max_tokens", "natural_output_tokens", "kv_cache_tokens",
               "block_size", "seed", "embedding_dim")


def build_config(argv: list[str] | None = None) -> tuple[SimConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m tools.simulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", "--served-model-name", dest="model", help="served model name")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=None)
    parser.add_argument("--enable-lora", dest="enable_lora", action="store_true", default=None)
    parser.add_argument("--lora-load-ms", dest="lora_load_ms", type=float)
    parser.add_argument("--log-level", default="info")
    defaults = SimConfig.model_fields
    for name in FIELD_FLAGS:
        kind = defaults[name].annotation
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=float if kind is float else int,
                            help=defaults[name].description)
    args = parser.parse_args(argv)
    named = ("model", "enable_prefix_caching", "enable_lora", "lora_load_ms", *FIELD_FLAGS)
    overrides = {k: v for k in named if (v := getattr(args, k)) is not None}
    if os.environ.get("VLLM_API_KEY"):  # as vLLM: read from the environment, so it is not on the command line
        overrides["api_key"] = os.environ["VLLM_API_KEY"]
    base = PRESETS[args.preset]().model_dump()
    return SimConfig(**{**base, **overrides}), args


QUIET_PATHS = ("/health", "/metrics")  # polled every few seconds by each gateway: an access line each is noise


class QuietProbes(logging.Filter):
    """Drops uvicorn's access lines of health checks and metrics scrapes unless the log level is debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else None
        return not (isinstance(path, str) and path.split("?", 1)[0] in QUIET_PATHS)


def main(argv: list[str] | None = None) -> None:
    cfg, args = build_config(argv)
    if args.log_level.lower() not in ("debug", "trace"):
        logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
