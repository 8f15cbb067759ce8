#!/bin/bash
# Step 3: the overload comparison at 1x, 2x and 4x the knee's cap, direct to vLLM and through the gateway
# (Redis store, an API key with limits, metrics), then through three gateway processes on the one Redis.
#   bash .cache/gpu/s/step3.sh        (carry .cache/gpu/s; right after step 2, vLLM still up)
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=3)" || { echo "vLLM is not up"; exit 3; }
export PYTHONPATH=$SCRATCH/gw:$SCRATCH/site PYTHONUNBUFFERED=1
cd $SCRATCH/w
CAP=${CAP:-$(python3 -c "import yaml; print(yaml.safe_load(open('policy.yaml'))['models'][0]['backends'][0]['cap'])")}
[ "$CAP" -gt 1 ] || { echo "no cap from the knee: $CAP"; exit 4; }
echo "cap $CAP"
RS=$(command -v redis-server || echo $SCRATCH/redis/redis-server)
LD_LIBRARY_PATH=$SCRATCH/redis/lib setsid nohup $RS --bind 127.0.0.1 --port 6390 --save "" --appendonly no \
  > $SCRATCH/w/redis.log 2>&1 < /dev/null & echo $! > $SCRATCH/w/redis.pid
export LLM_GATEWAY_ADMIN_SECRET=$(python3 -c "import secrets; print(secrets.token_urlsafe(32))")
for p in 8080 8081 8082; do
  setsid nohup python3 -m gateway serve --config $SCRATCH/w/policy.yaml --port $p --log-level warning \
    > $SCRATCH/w/gateway-$p.log 2>&1 < /dev/null & echo $! > $SCRATCH/w/gateway-$p.pid
done
for p in 8080 8081 8082; do
  for i in $(seq 1 60); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$p/ready', timeout=2)" 2>/dev/null && break; sleep 1; done
done
TOKEN=$(python3 -m gateway admin-token --config $SCRATCH/w/policy.yaml --ttl 2h)
KEY=$(python3 -m gateway keys --url http://127.0.0.1:8080 --token "$TOKEN" --json create --name gpu-bench \
  --rpm 1000000 --tpm 1000000000 | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
[ -n "$KEY" ] || { echo "no key"; tail -20 $SCRATCH/w/gateway-8080.log; exit 7; }
echo "three gateways ready, key issued at $(el)s"
L="$CAP,$((2*CAP)),$((4*CAP))"; L2="$((2*CAP)),$((4*CAP))"
LOAD="python3 $D/load.py --warmup 3 --measure ${MEASURE:-12} --grace 40 --per-proc 48 --max-procs 14"
if [ "${ONLY_FLEET:-0}" != 1 ]; then  # ONLY_FLEET=1: the three-gateway rows alone (a repeat after a fleet change)
$LOAD --label direct --levels $L --prewarm $CAP --out $OUT/overload-direct.json --budget-s 200
$LOAD --label gateway --url http://127.0.0.1:8080 --metrics-url http://127.0.0.1:8000 --api-key "$KEY" --prewarm 0 \
  --levels $L --out $OUT/overload-gateway.json --budget-s 200
fi
$LOAD --label gateway-x3 --url http://127.0.0.1:8080,http://127.0.0.1:8081,http://127.0.0.1:8082 \
  --metrics-url http://127.0.0.1:8000 --api-key "$KEY" --prewarm 0 --levels $L2 --out $OUT/overload-gateway3.json \
  --budget-s $(( ${STEP3_BUDGET:-560} - $(el) ))
for p in 8080 8081 8082; do
  echo "== gateway :$p"; python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$p/metrics').read().decode())" \
    | grep -E "^llm_gateway_(queue_depth|backend_in_flight|admission_rejected|requests_total|overhead_seconds_(sum|count))"
done > $OUT/gateway-metrics.txt 2>&1
for p in 8080 8081 8082; do echo "== gateway :$p"; tail -15 $SCRATCH/w/gateway-$p.log; done > $OUT/gateway-logs.txt
echo "step3 took $(el)s"
