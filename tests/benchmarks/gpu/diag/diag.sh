#!/bin/bash
# Where the gateway path's time to first token goes on the GPU: step 5 (distinct workload; the ceiling straight to
# the servers, then the default profile through a gateway) with diag/sampler.py beside it: both servers' running,
# waiting and KV use every 0.5 s, py-spy of each gateway for 25 s, its /metrics and open fds every 5 s.
# Stage (here): mkdir -p .cache/gpu/d && cp tests/benchmarks/gpu/diag/* .cache/gpu/d/ &&
#   pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12 -d .cache/gpu/d py-spy
# Run (device, after step 1 and `STAGE_ONLY=1 step2.sh`): carry .cache/gpu/s .cache/gpu/p2 .cache/gpu/d;
#   mkdir -p $OUT/r && OUT=$OUT/r bash .cache/gpu/d/diag.sh     (~250 s with the servers' start)
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}
python3 -m pip install -q --no-deps --no-index --target $SCRATCH/pyspy $D/py_spy-*.whl 2>&1 | tail -1
SPY=$SCRATCH/pyspy/bin/py-spy
python3 $D/sampler.py $OUT $SPY 320 > $OUT/sampler.log 2>&1 & S=$!
STEP5_BUDGET=${STEP5_BUDGET:-300} WORKLOADS=distinct PROFILES=${PROFILES:-ceiling,default} bash .cache/gpu/s/step5.sh 2>&1 \
  | grep -E "^\| distinct|PASS|FAIL|healthy|profiles|took"
kill $S 2>/dev/null; ls -la $OUT
