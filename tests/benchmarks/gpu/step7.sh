#!/bin/bash
# Step 7: a batch fills only what interactive traffic leaves, on the GPU. One vLLM BF16 server (:8000) scheduling
# by priority (`--scheduling-policy priority`, `--max-num-seqs` the cap), then tests/benchmarks/batch_fill.py
# against it (--url): a gateway of its own in front (cap CAP, the model's queue.reserve, the backend's
# scheduling_policy priority), an interactive closed loop of CAP/4 streams alone, a Batch API batch (openai SDK)
# alone, the two together, the interactive loop alone again; interactive TTFT p50/p99 with and without the batch,
# the batch's lines/s alone and beside the load, the share of the idle capacity it used. Results to $OUT.
#   bash .cache/gpu/s/step7.sh        (carry .cache/gpu/s; the site and model of steps 1-2 on this machine;
#                                      stops whatever earlier steps left running)
#   STEP7_DRY=1 OUT=/tmp/x bash tests/benchmarks/gpu/step7.sh   (on a CPU: the simulator stands in for the GPU
#                                      server and the runs are short: checks the command line and every run of
#                                      batch_fill.py, in ~1 minute)
# Knobs (environment): STEP7_BUDGET (300 s in all), CAP (64: about the knee of step 2), RESERVE (the policy's
# default, an eighth of the cap), INTERACTIVE (CAP/4 streams), LINES (8000: more than the two runs with the batch
# answer), BATCH_TOKENS (128 a line), OUTPUT_TOKENS (128 an interactive request), WARMUP (5 s), EAGER=1
# (--enforce-eager: up sooner, slower steps),
# VLLM_ARGS (more flags for the server).
# Several measurements on one server: RUNS="label|batch_fill flags;label|flags" (e.g. "preempt|;off|--no-preempt"):
# each run gets an equal share of what is left and writes batch_fill-LABEL.{json,txt}; KEEP=1 leaves the server up
# at the end, and a step started while it is still healthy on :8000 reuses it (a second command of runs, no restart).
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
BUDGET=${STEP7_BUDGET:-300}
DRY=${STEP7_DRY:-}
[ -f tests/benchmarks/batch_fill.py ] || { echo "run from the repository root"; exit 3; }
PY=${PYTHON:-python3}
CAP=${CAP:-64}
if [ -n "$DRY" ]; then LINES=${LINES:-3000}; BATCH_TOKENS=${BATCH_TOKENS:-16}; OUTPUT_TOKENS=${OUTPUT_TOKENS:-16}; WARMUP=${WARMUP:-1}; fi
WARMUP=${WARMUP:-5}

# run_fill REM URL MODEL [LABEL [FLAGS...]]: batch_fill.py's four runs, each cut so that all four fit in REM seconds
run_fill() {
  local rem=$1 url=$2 model=$3 label=${4:-} dur; shift 4 2>/dev/null || shift $#
  local name=batch_fill${label:+-$label}
  # four runs of WARMUP + dur, the gateway's start, the batch's upload and its cancel: ~30 s besides
  dur=$(( (rem - 30) / 4 - WARMUP ))
  [ $dur -gt 60 ] && dur=60
  # a dry run checks paths, not figures: short runs leave its overheads (the gateway's start, the upload, the
  # batch's cancel, the fills read after it) room on a loaded CPU
  [ -n "$DRY" ] && [ $dur -gt 8 ] && dur=8
  [ $dur -ge 5 ] || { echo "only ${rem}s left: no time for four runs"; return 7; }
  echo "batch_fill${label:+ ($label: $*)} against $url (cap $CAP), four runs of ${WARMUP}+${dur}s (${rem}s left)"
  timeout $(( rem + 10 )) $PY -m tests.benchmarks.batch_fill --url $url --model $model --cap $CAP \
    ${RESERVE:+--reserve $RESERVE} ${INTERACTIVE:+--interactive $INTERACTIVE} --lines ${LINES:-8000} \
    --batch-tokens ${BATCH_TOKENS:-128} --output-tokens ${OUTPUT_TOKENS:-128} --warmup $WARMUP --duration $dur \
    "$@" --json $OUT/$name.json 2>&1 | tee $OUT/$name.txt
  local rc=${PIPESTATUS[0]}; echo "batch_fill.py${label:+ $label} exit $rc at $(el)s"
  [ $rc -le 1 ] && [ -s $OUT/$name.json ]  # 1 with results: a target missed (the checks say which)
}

# run_all REM URL MODEL: run_fill once, or once for each of RUNS with an equal share of REM
run_all() {
  local rem=$1 url=$2 model=$3 rc=0 n i=0 label flags start; start=$(el)
  [ -n "${RUNS:-}" ] || { run_fill $rem $url $model; return $?; }
  IFS=';' read -ra items <<< "$RUNS"; n=${#items[@]}
  for item in "${items[@]}"; do
    label=${item%%|*}; flags=${item#*|}; [ "$flags" = "$item" ] && flags=
    # shellcheck disable=SC2086  # flags are words
    run_fill $(( (rem - ($(el) - start)) / (n - i) )) $url $model $label $flags || rc=$?
    i=$(( i + 1 ))
  done
  return $rc
}

if [ -n "$DRY" ]; then
  P=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  $PY -m tools.simulator --port $P --model qwen3-4b --preset reference-gpu --log-level warning \
    > $OUT/sim-$P.log 2>&1 & SIM=$!
  trap 'kill $SIM 2>/dev/null' EXIT
  for _ in $(seq 1 60); do $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$P/health', timeout=2)" \
    2>/dev/null && break; sleep 0.5; done
  run_all $(( BUDGET - $(el) )) http://127.0.0.1:$P qwen3-4b
  exit $?
fi

[ -f $SCRATCH/site/.done ] && [ -f $SCRATCH/q4b/config.json ] || { echo "NO site or model: run step1.sh and step2.sh first"; exit 3; }
for f in "$SCRATCH"/w/gateway-*.pid "$SCRATCH"/w/redis.pid; do [ -f "$f" ] && kill -TERM -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"; done
# the tree this runs in first: the gateway it measures is this commit's, whatever wheel step 2 unpacked
export PYTHONPATH=$PWD:$SCRATCH/gw:$SCRATCH/site PYTHONUNBUFFERED=1
if [ -f $SCRATCH/w/step7.kept ] && python3 $D/health.py 5 $SCRATCH/w/vllm-p8000.log 8000 >/dev/null 2>&1; then
  echo "the server step 7 kept is healthy: reused"; R=0
else
  rm -f $SCRATCH/w/step7.kept; bash $D/stop.sh
  bash $D/serve.sh p8000 --scheduling-policy priority --max-num-seqs $CAP ${EAGER:+--enforce-eager} ${VLLM_ARGS:-}
  python3 $D/health.py $(( BUDGET - 120 )) $SCRATCH/w/vllm-p8000.log 8000; R=$?
fi
grep -E "KV cache|Maximum concurrency|CUDA graph|torch.compile|Available|scheduling" $SCRATCH/w/vllm-p8000.log \
  | head -12 > $OUT/vllm-p8000.log
if [ $R != 0 ]; then tail -40 $SCRATCH/w/vllm-p8000.log | tee $OUT/vllm-failed.log; bash $D/stop.sh; exit 6; fi
echo "healthy at $(el)s"; nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | tee $OUT/gpu-memory.txt
run_all $(( BUDGET - $(el) - 20 )) http://127.0.0.1:8000 qwen3-4b   # 20 s kept for stop.sh
RC=$?
if [ -n "${KEEP:-}" ]; then touch $SCRATCH/w/step7.kept; echo "server kept up"; else bash $D/stop.sh; fi
echo "step7 took $(el)s"; exit $RC
