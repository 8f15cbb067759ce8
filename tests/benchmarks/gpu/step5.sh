#!/bin/bash
# Step 5: the routing profiles on real GPU servers. Two vLLM BF16 servers share the H200 (:8000 and :8001, 0.4 of
# its memory each, the same explicit KV cache, sized so that the active conversations need ~1.6x one server's
# cache), then tests/benchmarks/routing.py in its external mode: two agent-like workloads (tool time between
# turns; a system prompt per conversation, then one shared by all), each under every profile (the ceiling
# straight to the servers, the others through a fresh gateway), prefix caches emptied before each. Results to $OUT.
#   bash .cache/gpu/s/step5.sh        (carry .cache/gpu/s; the site and model of steps 1-2 on this machine;
#                                      stops whatever steps 2-4 left running)
#   STEP5_DRY=1 OUT=/tmp/x bash tests/benchmarks/gpu/step5.sh   (on a CPU: two simulated vLLM servers stand in
#                                      for the GPU ones and the workload is tiny: checks the command line and
#                                      every profile and workload path of routing.py, in ~1-2 minutes)
# Knobs (environment): STEP5_BUDGET (560 s in all), PROFILES (default: ceiling, default, least-in-flight,
# session-affinity; the last is dropped when the servers came up too late for 8 runs of 35 s; `cost` is the
# default with prefix-cost in prefix-affinity's place), WORKLOADS (distinct,hot; `pressure`: distinct with the
# active conversations' working set 1.05x both caches together: alone, the caches are sized so that ACTIVE
# conversations are that; with others, routing.py runs as many as make it on their caches), REPEAT (1: runs of
# every profile, interleaved), CONVS / ACTIVE / TURNS / TOOL (320 / 160 / 5 / 0.5,3), EAGER=1 (--enforce-eager:
# up ~1 min sooner, but no CUDA graphs, so decode steps are slower and TTFT includes more queueing: not comparable with a
# CUDA-graph run), KV_EVENTS=1 (the servers publish their KV cache events to 127.0.0.1:5557/5558 and the
# precise-prefix profile runs too, whatever PROFILES says; the site needs msgpack, build_site.sh ships it; in
# the dry run the simulators publish none, so it checks only the profile's command line and policy: load decides),
# PRIORITY=1 (both servers run --scheduling-policy priority and the gateways' backends say so: the default
# profile then sends cheapest prefill first, policies/prefill_order.py; profile default-arrival is the same
# without it, arrival order; ceiling and vllm-router send no priority, so vLLM serves them in arrival order).
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
BUDGET=${STEP5_BUDGET:-560}
DRY=${STEP5_DRY:-}
[ -f tests/benchmarks/routing.py ] || { echo "run from the repository root"; exit 3; }
if [ -n "$DRY" ]; then CONVS=${CONVS:-6}; ACTIVE=${ACTIVE:-3}; TURNS=${TURNS:-2}; TOOL=${TOOL:-0.01,0.05}; fi
SCHEDULING=fcfs; [ -n "${PRIORITY:-}" ] && SCHEDULING=priority
# The workloads (seeded; the same under every profile): ~2.3k-token prompts on average, 5 turns, 32 output tokens.
W="--conversations ${CONVS:-320} --active ${ACTIVE:-160} --turns ${TURNS:-5} --system-tokens 1800,2400 --user-tokens 100
   --own-tokens 100 --max-tokens 32 --tool-time ${TOOL:-0.5,3} --max-model-len 4096 --overflow 1.6
   --workloads ${WORKLOADS:-distinct,hot} --client-procs ${CLIENT_PROCS:-8} --repeat ${REPEAT:-1}
   --scheduling-policy $SCHEDULING"
PROFILES_GIVEN=${PROFILES:-}
PROFILES=${PROFILES:-ceiling,default,${ROUTER_CMD:+vllm-router,}least-in-flight,session-affinity}
with_events() { case ",$1," in *,precise-prefix,*) echo $1 ;; *) echo $1${KV_EVENTS:+,precise-prefix} ;; esac; }
PROFILES=$(with_events $PROFILES)
PY=${PYTHON:-python3}

# run_routing REM SERVERS MODEL LOGS GATEWAY_CMD EVENTS: every workload under every profile, each run cut at a
# share of REM; EVENTS: routing.py's KV event arguments (used with KV_EVENTS=1)
run_routing() {
  local rem=$1 servers=$2 model=$3 logs=$4 gw=$5 events=$6 nw np pt
  nw=$(echo "${WORKLOADS:-distinct,hot}" | tr ',' '\n' | grep -c .)
  np=$(echo $PROFILES | tr ',' '\n' | grep -c .); np=$(( np * $(echo ${CLIENT_PROCS:-1} | tr "," "\n" | grep -c .) * ${REPEAT:-1} ))
  pt=$(( (rem - 30 - 12 * nw * np) / (nw * np) ))
  if [ $pt -lt 35 ] && [ -z "$PROFILES_GIVEN" ]; then  # the comparison profile goes first when time is short
    PROFILES=$(with_events ceiling,default,least-in-flight); np=$(( $(echo $PROFILES | tr ',' '\n' | grep -c .) * ${REPEAT:-1} )); pt=$(( (rem - 30 - 12 * nw * np) / (nw * np) ))
  fi
  [ $pt -gt 150 ] && pt=150
  [ $pt -ge 25 ] || { echo "only ${rem}s left: no time for $np profiles x $nw workloads"; return 7; }
  echo "profiles $PROFILES on ${WORKLOADS:-distinct,hot}, each run cut at ${pt}s (${rem}s left)"
  timeout $(( rem + 10 )) $PY -m tests.benchmarks.routing --servers $servers --served-model $model \
    ${logs:+--server-logs $logs} ${KV_EVENTS:+$events} --gateway-cmd "$gw" ${GATEWAY_ALT:+"--gateway-alt=$GATEWAY_ALT"} ${ROUTER_CMD:+"--router-cmd=$ROUTER_CMD"} --profiles $PROFILES --profile-timeout $pt $W \
    --out $OUT/routing.json 2>&1 | tee $OUT/routing.txt
  local rc=${PIPESTATUS[0]}; echo "routing.py exit $rc at $(el)s"
  [ $rc -le 1 ] && [ -s $OUT/routing.json ]  # 1 with results: a target missed (the table says which)
}

if [ -n "$DRY" ]; then
  free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
  P0=$(free_port)
  P1=$(free_port)
  # sized as the GPU servers are (--print-kv-bytes), in tokens: the pressure workload's active count follows it
  KVT=$($PY -m tests.benchmarks.routing --print-kv-tokens $W) || exit 4
  for p in $P0 $P1; do
    $PY -m tools.simulator --port $p --model qwen3-4b --max-model-len 4096 --kv-cache-tokens $KVT \
      --log-level warning > $OUT/sim-$p.log 2>&1 & echo $! > $OUT/sim-$p.pid
  done
  trap 'for p in $P0 $P1; do kill $(cat $OUT/sim-$p.pid) 2>/dev/null; done' EXIT
  for p in $P0 $P1; do
    for _ in $(seq 1 60); do $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$p/health', timeout=2)" \
      2>/dev/null && break; sleep 0.5; done
  done
  E0=$(free_port)
  E1=$(free_port)
  run_routing $(( BUDGET - $(el) )) http://127.0.0.1:$P0,http://127.0.0.1:$P1 qwen3-4b "" "$PY -m gateway" \
    "--kv-events-ports $E0,$E1"
  exit $?
fi

[ -f $SCRATCH/site/.done ] && [ -f $SCRATCH/q4b/config.json ] || { echo "NO site or model: run step1.sh and step2.sh first"; exit 3; }
for f in "$SCRATCH"/w/gateway-*.pid "$SCRATCH"/w/redis.pid; do [ -f "$f" ] && kill -TERM -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"; done
bash $D/stop.sh
# the tree this runs in first: the gateway it measures is this commit's, whatever wheel step 2 unpacked
export PYTHONPATH=$PWD:$SCRATCH/gw:$SCRATCH/site PYTHONUNBUFFERED=1
# Qwen3-4B: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 147,456 bytes a token; ~290k tokens (~40 GiB) each.
KV=$(python3 -m tests.benchmarks.routing --model-dir $SCRATCH/q4b --print-kv-bytes $W) || exit 4
echo "KV cache per server: $KV bytes ($(( KV / 147456 )) tokens) for ${WORKLOADS:-distinct,hot}"
export VLLM_SERVER_DEV_MODE=1  # POST /reset_prefix_cache between profiles
# Both at once: the explicit KV size spares the second its memory profile of the first. The same flags give the
# same torch.compile cache key, so :8001 compiles into a cache root of its own rather than race :8000 writing the
# shared one (:8000 keeps the default root, where step 2's compile of this configuration may already be).
kve() { [ -n "${KV_EVENTS:-}" ] && echo "--kv-events-config {\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$1\",\"topic\":\"kv\"}"; }
SCHED=${PRIORITY:+--scheduling-policy priority}
PORT=8000 GPU_UTIL=0.4 bash $D/serve.sh r8000 --kv-cache-memory-bytes $KV --enable-log-requests ${EAGER:+--enforce-eager} $(kve 5557) $SCHED
PORT=8001 GPU_UTIL=0.4 VLLM_CACHE_ROOT=$SCRATCH/vllm-cache-8001 \
  bash $D/serve.sh r8001 --kv-cache-memory-bytes $KV --enable-log-requests ${EAGER:+--enforce-eager} $(kve 5558) $SCHED
python3 $D/health.py 330 $SCRATCH/w/vllm-r8000.log 8000 & H0=$!
python3 $D/health.py 330 $SCRATCH/w/vllm-r8001.log 8001 & H1=$!
wait $H0; R0=$?; wait $H1; R1=$?
for p in 8000 8001; do
  grep -E "KV cache|Maximum concurrency|kv_cache_memory_bytes|CUDA graph|torch.compile|Available" \
    $SCRATCH/w/vllm-r$p.log | head -12 > $OUT/vllm-r$p.log
done
if [ $R0 != 0 ] || [ $R1 != 0 ]; then
  for p in 8000 8001; do echo "== :$p"; tail -40 $SCRATCH/w/vllm-r$p.log; done | tee $OUT/vllm-failed.log; exit 6
fi
echo "both healthy at $(el)s"; nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | tee $OUT/gpu-memory.txt
run_routing $(( BUDGET - $(el) - 20 )) http://127.0.0.1:8000,http://127.0.0.1:8001 qwen3-4b \
  $SCRATCH/w/vllm-r8000.log,$SCRATCH/w/vllm-r8001.log "python3 -m gateway" \
  "--kv-events-ports 5557,5558 --model-dir $SCRATCH/q4b"   # 20 s kept for stop.sh
RC=$?
bash $D/stop.sh; echo "step5 took $(el)s"; exit $RC
