#!/bin/bash
# Step 6: BF16 and FP8 servers of the same model sharing the H200 (:8000 and :8001, 0.4 of its memory and the same
# explicit KV cache each) as two variants, `bf16` and `fp8`, of one model at 50/50 through one gateway. First a
# short `knee` of each server, both swept at once (they share the GPU under the gateway's load too), and
# `knee --compare`; then, per total load level, a fresh gateway, `knee` through it (so each server meets half the
# streams), each server's own output rate in the measured window (rates.py) and GET /admin/variants; last,
# variants_vs_knee.py sets the per-variant TTFT p50 and tok/s beside knee's at the same per-server level.
#   bash .cache/gpu/s/step6.sh        (carry .cache/gpu/s; the site and model of steps 1-2 on this machine;
#                                      stops whatever earlier steps left running)
# Knobs (environment): STEP6_BUDGET (560 s in all), KNEE_LEVELS (16,32,64,128,192 per server), KNEE_DURATION (8 s),
# GW_LEVELS (total streams through the gateway: "64 128 256"), GW_DURATION (10 s), KV_BYTES (20 GiB each),
# FP8_ARGS (default --quantization fp8), VLLM_ARGS (more flags for both servers).
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
BUDGET=${STEP6_BUDGET:-560}
[ -f $SCRATCH/site/.done ] && [ -f $SCRATCH/q4b/config.json ] || { echo "NO site or model: run step1.sh and step2.sh first"; exit 3; }
(cd $SCRATCH/w && PYTHONPATH=$SCRATCH/gw:$SCRATCH/site python3 -c "from policies.config import Variant") \
  || { echo "the gateway's wheel in $SCRATCH/gw has no variants: rebuild it (build_site.sh) and rerun step 2"; exit 5; }
for f in "$SCRATCH"/w/gateway-*.pid "$SCRATCH"/w/redis.pid; do [ -f "$f" ] && kill -TERM -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"; done
bash $D/stop.sh
# 20 GiB each (~145k tokens at 147,456 bytes a token): far more than 128 streams of 384 tokens; equal for both,
# since without an explicit size the second server to start gets what the first left.
KV=${KV_BYTES:-21474836480}
PORT=8000 GPU_UTIL=0.4 bash $D/serve.sh v-bf16 --kv-cache-memory-bytes $KV ${VLLM_ARGS:-}
PORT=8001 GPU_UTIL=0.4 bash $D/serve.sh v-fp8 --kv-cache-memory-bytes $KV ${VLLM_ARGS:-} ${FP8_ARGS---quantization fp8}
python3 $D/health.py 330 $SCRATCH/w/vllm-v-bf16.log 8000 & H0=$!
python3 $D/health.py 330 $SCRATCH/w/vllm-v-fp8.log 8001 & H1=$!
wait $H0; R0=$?; wait $H1; R1=$?
for v in bf16 fp8; do
  grep -E "KV cache|Maximum concurrency|kv_cache_memory_bytes|fp8|Fp8|CUDA graph|torch.compile" \
    $SCRATCH/w/vllm-v-$v.log | head -12 > $OUT/vllm-v-$v.log
done
if [ $R0 != 0 ] || [ $R1 != 0 ]; then
  for v in bf16 fp8; do echo "== $v"; tail -40 $SCRATCH/w/vllm-v-$v.log; done | tee $OUT/vllm-failed.log; exit 6
fi
echo "both healthy at $(el)s"; nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | tee $OUT/gpu-memory.txt
export PYTHONPATH=$SCRATCH/gw:$SCRATCH/site PYTHONUNBUFFERED=1
cd $SCRATCH/w || exit 2   # not the repo root: the gateway comes from the wheel
KNEE="python3 -m gateway knee --model qwen3-4b --prompt-tokens 256 --output-tokens 128 --warmup 2"
$KNEE --url http://127.0.0.1:8000 --levels ${KNEE_LEVELS:-16,32,64,128,192} --duration ${KNEE_DURATION:-8} --max-time 150 \
  --out $OUT/knee6-bf16 > $OUT/knee6-bf16.txt 2>&1 & K0=$!
$KNEE --url http://127.0.0.1:8001 --levels ${KNEE_LEVELS:-16,32,64,128,192} --duration ${KNEE_DURATION:-8} --max-time 150 \
  --out $OUT/knee6-fp8 > $OUT/knee6-fp8.txt 2>&1 & K1=$!
wait $K0; wait $K1; cat $OUT/knee6-bf16.txt $OUT/knee6-fp8.txt
python3 -m gateway knee --compare $OUT/knee6-bf16/knee-*.json $OUT/knee6-fp8/knee-*.json --label bf16 --label fp8 \
  --out $OUT 2>&1 | tee $OUT/knee-compare.txt
echo "knees done at $(el)s"
cat > $SCRATCH/w/policy-variants.yaml <<YAML
listen: {host: 127.0.0.1, port: 8080}
store: {kind: sqlite, path: "$SCRATCH/w/keys-variants.db"}
timeouts: {read: 300}
models:
  - name: qwen3-4b
    queue: {max_depth: 4096, max_wait: 120}
    variants:
      - name: bf16
        weight: 50
        backends: [{name: h200-bf16, url: "http://127.0.0.1:8000"}]
      - name: fp8
        weight: 50
        backends: [{name: h200-fp8, url: "http://127.0.0.1:8001"}]
YAML
cp $SCRATCH/w/policy-variants.yaml $OUT/
LLM_GATEWAY_ADMIN_SECRET=$(python3 -c "import secrets; print(secrets.token_urlsafe(32))"); export LLM_GATEWAY_ADMIN_SECRET
GD=${GW_DURATION:-10}
get() { python3 -c "import sys, urllib.request as u; r = u.Request(sys.argv[1], headers={'authorization': 'Bearer ' + sys.argv[2]}); print(u.urlopen(r, timeout=10).read().decode())" "$@"; }
for TOT in ${GW_LEVELS:-64 128 256}; do
  [ $(( BUDGET - $(el) )) -ge 55 ] || { echo "gw-$TOT skipped: $(( BUDGET - $(el) ))s left"; continue; }
  R=$OUT/gw-$TOT; mkdir -p $R; rm -f $SCRATCH/w/keys-variants.db*
  setsid nohup python3 -m gateway serve --config $SCRATCH/w/policy-variants.yaml --log-level warning \
    > $SCRATCH/w/gateway-variants.log 2>&1 < /dev/null & echo $! > $SCRATCH/w/gateway-8080.pid
  for _ in $(seq 1 60); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/ready', timeout=2)" 2>/dev/null && break; sleep 1; done
  TOKEN=$(python3 -m gateway admin-token --config $SCRATCH/w/policy-variants.yaml --ttl 1h)
  KEY=$(python3 -m gateway keys --url http://127.0.0.1:8080 --token "$TOKEN" --json create --name variants-bench \
    --rpm 1000000 --tpm 1000000000 | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
  if [ -z "$KEY" ]; then echo "gw-$TOT: no key"; tail -20 $SCRATCH/w/gateway-variants.log
  else
    # each server's own rate inside knee's measured window (2 s warm-up, ~2 s to start the client processes)
    python3 $D/rates.py --urls http://127.0.0.1:8000,http://127.0.0.1:8001 --labels bf16,fp8 --delay 4 \
      --seconds $(( GD - 3 )) --out $R/rates.json > /dev/null & RP=$!
    $KNEE --url http://127.0.0.1:8080 --api-key "$KEY" --levels $TOT --duration $GD --max-time 90 --out $R > $R/knee.txt 2>&1
    wait $RP
    get "http://127.0.0.1:8080/admin/variants?window=$GD" "$TOKEN" > $R/variants.json
    get "http://127.0.0.1:8080/admin/variants" "$TOKEN" > $R/variants-all.json
    python3 -m gateway variants --url http://127.0.0.1:8080 --token "$TOKEN" --by-load > $R/variants.txt 2>&1
    echo "== gw-$TOT (each server ~$(( TOT / 2 )) streams) at $(el)s"; tail -4 $R/knee.txt; cat $R/variants.txt
  fi
  kill -TERM -- "-$(cat $SCRATCH/w/gateway-8080.pid)" 2>/dev/null; rm -f $SCRATCH/w/gateway-8080.pid; sleep 1
done
tail -20 $SCRATCH/w/gateway-variants.log > $OUT/gateway-variants.log
python3 $D/variants_vs_knee.py $OUT | tee $OUT/variants-vs-knee.txt
bash $D/stop.sh; echo "step6 took $(el)s"
