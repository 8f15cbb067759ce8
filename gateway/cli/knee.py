"""`llm-gateway knee`: sweep one backend's concurrency, find its throughput knee, optionally write it as its cap.

It talks to the backend directly (not through the gateway), so the figures are the backend's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

EPILOG = """\
example:
  llm-gateway knee --url http://127.0.0.1:8001 --model Qwen/Qwen3-4B --slo-ttft-p99 0.5 \\
      --write-cap policy.yaml --backend gpu-a
Writes knee-<model>-<time>.json and .png into --out, prints a table, and with --write-cap sets that
backend's `cap:` (comments and layout of the file are kept).

  llm-gateway knee --compare knee-bf16.json knee-fp8.json --label bf16 --label fp8 --out .
One table and one plot (knee-compare-<time>.png) of sweeps made earlier, the first one the baseline."""


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        levels = ()
    if not levels or levels[0] < 1 or levels[-1] > 100_000:
        raise argparse.ArgumentTypeError(f"not a list of concurrency levels: {text!r} (e.g. 1,2,4,8,16)")
    return levels


N = TypeVar("N", int, float)  # a positive number parsed from the command line


def _positive(kind: Callable[[str], N]) -> Callable[[str], N]:
    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
        return value
    return parse


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    knee = sub.add_parser("knee", help="measure a backend's throughput knee; optionally write it as its cap",
                          description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    knee.add_argument("--url", help="the backend's base URL, e.g. http://127.0.0.1:8001 (required to sweep)")
    knee.add_argument("--model", help="the model name the backend serves (required to sweep)")
    knee.add_argument("--compare", nargs="+", metavar="SWEEP.json",
                      help="compare sweeps made earlier instead of sweeping: one table and one plot")
    knee.add_argument("--label", action="append", help="with --compare: a name per sweep, in order "
                      "(default: from the file names)")
    knee.add_argument("--per-process", type=_positive(int), default=64, metavar="N",
                      help="streams one client process drives; larger levels spread over processes (default 64)")
    knee.add_argument("--max-processes", type=_positive(int), metavar="N",
                      help="client processes at most (default: the CPU count)")
    knee.add_argument("--levels", type=_levels, default=(1, 2, 4, 8, 16, 32, 64),
                      help="concurrency levels, comma-separated (default 1,2,4,8,16,32,64)")
    knee.add_argument("--prompt-tokens", type=_positive(int), default=256, help="prompt length (default 256)")
    knee.add_argument("--output-tokens", type=_positive(int), default=64, help="output length (default 64)")
    window = knee.add_mutually_exclusive_group()
    window.add_argument("--duration", type=_positive(float), help="seconds measured per level (default 10)")
    window.add_argument("--requests", type=_positive(int), help="completed requests measured per level")
    knee.add_argument("--min-requests", type=_positive(int), metavar="N",
                      help="with --duration: keep each level's window open until at least N requests completed "
                           "in it (a slow server then takes longer instead of giving a window without latencies)")
    knee.add_argument("--max-level-time", type=_positive(float), default=300.0, metavar="SECONDS",
                      help="with --requests or --min-requests: the longest one level's window may take "
                           "(default 300)")
    knee.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per level (default 2)")
    knee.add_argument("--slo-ttft-p99", type=_positive(float), metavar="SECONDS",
                      help="never recommend a level whose TTFT p99 exceeds this")
    knee.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                      help="the backend's API key, if it has one (default: $VLLM_API_KEY)")
    knee.add_argument("--request-timeout", type=_positive(float), default=60.0, help="seconds (default 60)")
    knee.add_argument("--max-time", type=_positive(float), default=3600.0,
                      help="seconds for the whole sweep (default 3600)")
    knee.add_argument("--out", default=".", help="folder for the JSON and PNG (default: current folder)")
    knee.add_argument("--write-cap", metavar="POLICY_FILE", help="set the recommended cap in this policy file")
    knee.add_argument("--backend", help="with --write-cap: the backend's name (`name`, else <model>-<index>)")
    knee.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tools.knee.report import (
        build_report,
        file_stem,
        format_table,
        write_json,
        write_png,
    )
    from tools.knee.run import run_sweep
    from tools.knee.sweep import Progress, SweepError, SweepSpec
    from policies.capfile import CapFileError, locate, write_cap

    if args.compare:
        return compare(args)
    if not args.url or not args.model:
        return _fail("--url and --model are required to sweep (or give --compare with sweep records)", 2)
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return _fail(f"--url must be an http:// or https:// base URL, got {args.url!r}", 2)
    if args.min_requests and args.requests:
        return _fail("--min-requests goes with --duration, not --requests", 2)
    if bool(args.write_cap) != bool(args.backend):
        return _fail("--write-cap and --backend go together", 2)
    if args.write_cap:  # a typo in the backend's name should fail now, not after a long sweep
        try:
            locate(Path(args.write_cap).read_text(encoding="utf-8"), args.backend, args.write_cap)
        except (OSError, CapFileError) as exc:
            return _fail(str(exc) if isinstance(exc, CapFileError) else f"{args.write_cap}: cannot read: {exc}", 2)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        spec = SweepSpec(url=args.url.rstrip("/"), model=args.model, levels=args.levels,
                         prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                         duration=None if args.requests else (args.duration or 10.0), requests=args.requests,
                         min_requests=args.min_requests, max_level_time=args.max_level_time, warmup=args.warmup, api_key=args.api_key, request_timeout=args.request_timeout,
                         max_time=args.max_time, per_process=args.per_process,
                         max_processes=args.max_processes)
    except (OSError, ValueError) as exc:
        return _fail(str(exc), 2)
    try:
        result = asyncio.run(run_sweep(spec, Progress()))
    except SweepError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return _fail("interrupted; nothing written", 130)
    report = build_report(result, args.slo_ttft_p99)
    stem = file_stem(args.model, result.started_at)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    write_json(report, json_path)
    written = [json_path]
    try:
        write_png(report, png_path)
        written.append(png_path)
    except ModuleNotFoundError as exc:  # matplotlib is the optional extra `llm-gateway[knee]`
        print(f"no plot: {exc.name} is not installed (pip install 'llm-gateway[knee]')", file=sys.stderr)
    print(format_table(report))
    print(f"wrote {' and '.join(map(str, written))}")
    if not args.write_cap:
        return 0
    cap = report["knee"]["recommended"]
    if cap is None:
        return _fail(f"{args.write_cap} left unchanged: no cap to recommend", 1)
    try:
        previous = write_cap(args.write_cap, args.backend, cap)
    except CapFileError as exc:
        return _fail(str(exc), 1)
    print(f"{args.write_cap}: backend {args.backend}: cap {previous if previous is not None else 'unset'} -> {cap}")
    return 0


def compare(args: argparse.Namespace) -> int:
    import time

    from tools.knee.compare import CompareError, format_compare, label_of, load, write_compare_png

    paths = [Path(p) for p in args.compare]
    labels = args.label or [label_of(p) for p in paths]
    if len(labels) != len(paths):
        return _fail(f"--label given {len(labels)} times for {len(paths)} sweeps: give one per sweep or none", 2)
    try:
        reports = [load(p) for p in paths]
    except CompareError as exc:
        return _fail(str(exc), 2)
    print(format_compare(reports, labels))
    out = Path(args.out)
    png = out / f"knee-compare-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.png"
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_compare_png(reports, labels, png)
    except ModuleNotFoundError as exc:
        print(f"no plot: {exc.name} is not installed (pip install 'llm-gateway[knee]')", file=sys.stderr)
        return 0
    except OSError as exc:
        return _fail(f"cannot write {png}: {exc}", 1)
    print(f"wrote {png}")
    return 0


def _fail(message: str, status: int) -> int:
    print(f"llm-gateway knee: {message}", file=sys.stderr)
    return status
