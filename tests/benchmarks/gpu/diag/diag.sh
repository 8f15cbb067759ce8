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
SPY=$SCRATCH/pyspy/bin/py-spy; [ -n "${NO_SPY:-}" ] && SPY=/bin/true  # NO_SPY=1: no sampling pauses in the gateway
python3 $D/sampler.py $OUT $SPY 320 > $OUT/sampler.log 2>&1 & S=$!
{ ulimit -n; sysctl net.core.somaxconn net.ipv4.tcp_max_syn_backlog net.ipv4.ip_local_port_range; nproc; } > $OUT/limits.txt 2>&1
# An older tree beside the current one: stage with `git archive COMMIT gateway policies backends | tar -x -C
# .cache/gpu/old` and carry .cache/gpu/old; profiles named PROFILE@old run it
# vLLM's router for the vllm-router profile: carry .cache/gpu/r (pip download --no-deps vllm-router==0.1.17) once:
#   python3 -m pip install --no-deps --no-index --target $SCRATCH/router .cache/gpu/r/*.whl
[ -d $SCRATCH/router/vllm_router ] && export ROUTER_CMD="env PYTHONPATH=$SCRATCH/router:$SCRATCH/site python3 -m vllm_router.launch_router"
[ -d .cache/gpu/old ] && export GATEWAY_ALT="old=env PYTHONPATH=$PWD/.cache/gpu/old:$SCRATCH/site python3 -m gateway"
STEP5_BUDGET=${STEP5_BUDGET:-300} WORKLOADS=${WORKLOADS:-distinct} PROFILES=${PROFILES:-ceiling,default} bash .cache/gpu/s/step5.sh 2>&1 \
  | grep -E "^\| (distinct|hot)|PASS|FAIL|healthy|profiles|took|client path"
kill $S 2>/dev/null; ls -la $OUT
