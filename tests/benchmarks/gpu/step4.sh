#!/bin/bash
# Step 4: stop the gateways and vLLM, restart vLLM with --quantization fp8 (one flag changed), knee again,
# then `llm-gateway knee --compare` BF16 vs FP8.
#   bash .cache/gpu/s/step4.sh        (carry .cache/gpu/s; right after step 3)
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
[ -d $SCRATCH/site ] || { echo "NO $SCRATCH/site: a fresh machine"; exit 3; }
for f in $SCRATCH/w/gateway-*.pid $SCRATCH/w/redis.pid; do [ -f $f ] && kill -TERM -- -$(cat $f) 2>/dev/null; done
bash $D/stop.sh
bash $D/serve.sh fp8 --quantization fp8
export PYTHONPATH=$SCRATCH/gw:$SCRATCH/site PYTHONUNBUFFERED=1
cd $SCRATCH/w
if ! python3 $D/health.py 330 $SCRATCH/w/vllm-fp8.log; then tail -60 $SCRATCH/w/vllm-fp8.log; tail -300 $SCRATCH/w/vllm-fp8.log > $OUT/vllm-fp8.log; exit 6; fi
echo "healthy at $(el)s"; bash $D/smoke.sh
REM=$(( ${STEP4_BUDGET:-575} - $(el) )); echo "knee budget ${REM}s"
python3 -m gateway knee --url http://127.0.0.1:8000 --model qwen3-4b --levels ${LEVELS:-1,2,4,8,16,32,64,96,128,192,256,384,512} \
  --prompt-tokens 256 --output-tokens 128 --duration ${DURATION:-8} --warmup 2 --max-time $REM --out $OUT/knee-fp8 2>&1 | tee $OUT/knee-fp8.txt
grep -E "Maximum concurrency|KV cache|fp8|Fp8|CUDA graph" $SCRATCH/w/vllm-fp8.log | head -12 > $OUT/vllm-fp8.log
bash $D/stop.sh; echo "step4 took $(el)s"
