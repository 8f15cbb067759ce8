#!/bin/bash
# Step 5: the routing profiles on real GPU servers. Two vLLM BF16 servers share the H200 (:8000 and :8001, 0.4 of
# its memory each, the same explicit KV cache, sized so that the active conversations need ~1.6x one server's
# cache), then tests/benchmarks/routing.py in its external mode: the agent-like workload (tool time between
# turns) through one fresh gateway per routing profile, prefix caches emptied before each. Results to $OUT.
#   bash .cache/gpu/s/step5.sh        (carry .cache/gpu/s; the site and model of steps 1-2 on this machine;
#                                      stops whatever steps 2-4 left running)
# Knobs (environment): STEP5_BUDGET (560 s in all), PROFILES (default: three if the servers are up in time, else
# two), CONVS / ACTIVE (480 / 160), EAGER=1 (--enforce-eager: up ~1 min sooner, but no CUDA graphs, so decode
# steps are slower and TTFT includes more queueing: not comparable with a CUDA-graph run), KV_EVENTS=1 (the servers
# publish their KV cache events to 127.0.0.1:5557/5558 and the precise-prefix profile runs too; the site needs
# msgpack, build_site.sh ships it).
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
BUDGET=${STEP5_BUDGET:-560}
[ -f tests/benchmarks/routing.py ] || { echo "run from the repository root"; exit 3; }
[ -f $SCRATCH/site/.done ] && [ -f $SCRATCH/q4b/config.json ] || { echo "NO site or model: run step1.sh and step2.sh first"; exit 3; }
for f in "$SCRATCH"/w/gateway-*.pid "$SCRATCH"/w/redis.pid; do [ -f "$f" ] && kill -TERM -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"; done
bash $D/stop.sh
export PYTHONPATH=$SCRATCH/gw:$SCRATCH/site PYTHONUNBUFFERED=1
# The workload (seeded; the same under every profile): ~2.3k-token prompts on average, 5 turns, 32 output tokens.
W="--conversations ${CONVS:-480} --active ${ACTIVE:-160} --turns 5 --system-tokens 1800,2400 --user-tokens 100
   --max-tokens 32 --tool-time 0.5,3 --max-model-len 4096 --overflow 1.6"
# Qwen3-4B: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 147,456 bytes a token; ~290k tokens (~40 GiB) each.
KV=$(python3 -m tests.benchmarks.routing --model-dir $SCRATCH/q4b --print-kv-bytes $W) || exit 4
echo "KV cache per server: $KV bytes ($(( KV / 147456 )) tokens)"
export VLLM_SERVER_DEV_MODE=1  # POST /reset_prefix_cache between profiles
# Both at once: the explicit KV size spares the second its memory profile of the first. The same flags give the
# same torch.compile cache key, so :8001 compiles into a cache root of its own rather than race :8000 writing the
# shared one (:8000 keeps the default root, where step 2's compile of this configuration may already be).
kve() { [ -n "${KV_EVENTS:-}" ] && echo "--kv-events-config {\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$1\",\"topic\":\"kv\"}"; }
PORT=8000 GPU_UTIL=0.4 bash $D/serve.sh r8000 --kv-cache-memory-bytes $KV --enable-log-requests ${EAGER:+--enforce-eager} $(kve 5557)
PORT=8001 GPU_UTIL=0.4 VLLM_CACHE_ROOT=$SCRATCH/vllm-cache-8001 \
  bash $D/serve.sh r8001 --kv-cache-memory-bytes $KV --enable-log-requests ${EAGER:+--enforce-eager} $(kve 5558)
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
REM=$(( BUDGET - $(el) - 20 ))   # 20 s for stop.sh at the end
if [ -z "${PROFILES:-}" ]; then
  PROFILES=least-in-flight,prefix-affinity; [ $REM -ge 330 ] && PROFILES=$PROFILES,session-affinity
fi
[ -n "${KV_EVENTS:-}" ] && PROFILES=$PROFILES,precise-prefix
NP=$(echo $PROFILES | tr ',' '\n' | grep -c .)
PT=$(( (REM - 30 - 10 * NP) / NP )); [ $PT -gt 150 ] && PT=150
[ $PT -ge 30 ] || { echo "only ${REM}s left: no time for $NP profiles"; bash $D/stop.sh; exit 7; }
echo "profiles $PROFILES, each cut at ${PT}s (${REM}s left)"
timeout $(( REM + 10 )) python3 -m tests.benchmarks.routing --servers http://127.0.0.1:8000,http://127.0.0.1:8001 \
  --served-model qwen3-4b --server-logs $SCRATCH/w/vllm-r8000.log,$SCRATCH/w/vllm-r8001.log \
  ${KV_EVENTS:+--kv-events-ports 5557,5558 --model-dir $SCRATCH/q4b} \
  --gateway-cmd "python3 -m gateway" --profiles $PROFILES --profile-timeout $PT $W --out $OUT/routing.json \
  2>&1 | tee $OUT/routing.txt
echo "routing.py exit ${PIPESTATUS[0]} at $(el)s"
bash $D/stop.sh; echo "step5 took $(el)s"
