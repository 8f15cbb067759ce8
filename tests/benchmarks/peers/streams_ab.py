"""CPU per stream of this tree's gateway against another tree's, side by side on one stand-in:
`python -m tests.benchmarks.peers.streams_ab --baseline-tree DIR`.

`run.py --baseline-tree` gives the headline figure (events/s and CPU µs per event over whole rounds); this one
finds where a difference comes from. Both gateways start as `run.py` starts them (one core, the same policy),
then for each round, in alternating order: optionally `--plain-first` seconds of non-streaming requests at c=64
(what `run.py` does before each streaming phase), then 64 streams for `--seconds`; per stream: the process's CPU
(utime+stime) and minor page faults. `--profile S` ends with S seconds of py-spy (`--native`) on each under the
same sequence, raw stacks to .cache/bench/streams-ab-<name>.txt, for a diff by function. `--env-this NAME=VALUE`
sets a variable for this tree's gateway only (e.g. a MALLOC_*_ setting); `--variants-this` makes this tree's
models two variants each (then DIR may be this tree: the cost of variants alone)."""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tests.benchmarks.peers import install
from tests.benchmarks.peers.run import REPO, WARMUP_STREAMS, Lab, run_wrk, stream_round, write_script
from tests.benchmarks.peers.systems import LOAD_CORE, Procs, System, start_gateway, start_standin

STREAMS = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-tree", required=True, metavar="DIR")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=5.0, help="streaming seconds per round and system")
    p.add_argument("--plain-first", type=float, default=0.0, metavar="SECONDS",
                   help="non-streaming requests at c=64 before each streaming phase")
    p.add_argument("--profile", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--env-this", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--variants-this", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1 and not args.profile:
        p.error("nothing to do: --rounds 0 and no --profile")
    if any("=" not in e for e in args.env_this):
        p.error("--env-this takes NAME=VALUE")
    return args


def minor_faults(system: System) -> int:
    with open(f"/proc/{system.procs[0].pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[7])


def streams(system: System, seconds: float) -> dict:
    return stream_round(system, argparse.Namespace(streams=STREAMS, seconds=seconds, stream_timeout=60 + seconds))


def plain(system: System, work: Path, seconds: float) -> None:
    if seconds > 0:
        run_wrk(system.json_url, write_script(work / f"{system.name}.lua", system.auth), 64, seconds)


def measure(system: System, work: Path, args) -> tuple[float, float, float]:
    """(CPU µs per stream, minor faults per stream, token events/s) of one streaming phase."""
    plain(system, work, args.plain_first)
    cpu, faults = system.cpu_seconds(), minor_faults(system)
    got = streams(system, args.seconds)
    n = got["streams"] + WARMUP_STREAMS
    return (system.cpu_seconds() - cpu) / n * 1e6, (minor_faults(system) - faults) / n, got["token_events_per_s"]


def profile(system: System, work: Path, args) -> Path:
    raw = REPO / ".cache" / "bench" / f"streams-ab-{system.name}.txt"
    raw.parent.mkdir(parents=True, exist_ok=True)
    plain(system, work, args.plain_first)
    spy = subprocess.Popen(
        ["taskset", "-c", str(LOAD_CORE), str(install.venv_python("tools").with_name("py-spy")), "record",
         "--pid", str(system.procs[0].pid), "--rate", "250", "--duration", str(int(args.profile)),
         "--format", "raw", "--output", str(raw), "--native"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # py-spy attaches
        streams(system, args.profile + 1)
        spy.communicate(timeout=args.profile + 60)
    finally:
        if spy.poll() is None:
            spy.kill()
            spy.wait(5)
    return raw


def main(argv=None) -> int:
    args = parse_args(argv)
    lab = Lab()
    lab.pin()
    install.ensure_all()
    work = Path(tempfile.mkdtemp(prefix="streams-ab-"))
    procs = Procs(work)
    atexit.register(procs.stop_all)
    try:
        standin = start_standin(procs, work)
        this = start_gateway(procs, work, standin, variants=args.variants_this,
                             env_extra=dict(e.split("=", 1) for e in args.env_this))
        base = start_gateway(procs, work, standin, name="baseline",
                             env_extra={"PYTHONPATH": str(Path(args.baseline_tree).resolve())})
        pair = [this, base]
        for system in pair:
            streams(system, 2.0)  # warm: imports, connections, the first allocations
        rows: dict[str, list[tuple[float, float, float]]] = {s.name: [] for s in pair}
        for r in range(args.rounds):
            for system in pair if r % 2 == 0 else pair[::-1]:
                rows[system.name].append(measure(system, work, args))
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1][0]:.1f} µs/stream, {v[-1][1]:.1f} faults/stream"
                                                 for n, v in rows.items()), flush=True)
        if args.rounds:
            cpu = {n: statistics.median(x[0] for x in v) for n, v in rows.items()}
            events = {n: statistics.median(x[2] for x in v) for n, v in rows.items()}
            print(json.dumps({
                "cpu_us_per_stream": cpu, "cpu_this_vs_baseline": cpu["gateway"] / cpu["baseline"],
                "events_per_s": events, "events_this_vs_baseline": events["gateway"] / events["baseline"],
                "faults_per_stream": {n: [round(x[1], 1) for x in v] for n, v in rows.items()},
                "cpu_per_round": [round(a[0] / b[0], 3) for a, b in zip(rows["gateway"], rows["baseline"])],
            }, indent=1))
        if args.profile:
            for system in pair:
                print(f"py-spy raw stacks of {system.name}: {profile(system, work, args)}")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
