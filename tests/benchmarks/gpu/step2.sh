#!/bin/bash
# Step 2: stage part 2, check the hash, unpack the site and the gateway's wheel, start vLLM BF16, then
# `llm-gateway knee` levels 1..512 against it, writing the recommended cap into the policy file.
#   bash .cache/gpu/s/step2.sh        (carry .cache/gpu/s .cache/gpu/p2; right after step 1: the machine stays 30 s)
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
[ -d $SCRATCH/w ] || { echo "NO $SCRATCH/w: a fresh machine, run step1.sh first"; exit 3; }
cp .cache/gpu/p2/site.tar.xz.part* $SCRATCH/w/ || exit 2
SHA=$(cat $SCRATCH/w/site.tar.xz.part* | sha256sum | cut -d' ' -f1); grep -q $SHA $D/site.sha256 || { echo "SHA MISMATCH $SHA"; exit 4; }
if [ ! -f $SCRATCH/site/.done ]; then
  mkdir -p $SCRATCH/site
  if command -v xz >/dev/null; then cat $SCRATCH/w/site.tar.xz.part* | xz -dc -T0 | tar -x -C $SCRATCH/site
  else cat $SCRATCH/w/site.tar.xz.part* | python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('$SCRATCH/site', filter='fully_trusted')"; fi && touch $SCRATCH/site/.done
fi
rm -rf $SCRATCH/gw && python3 -m zipfile -e $D/llm_gateway-*.whl $SCRATCH/gw || exit 5
echo "unpacked at $(el)s"
for i in $(seq 1 60); do [ -f $SCRATCH/w/build.rc ] && break; sleep 2; done; echo "build.rc=$(cat $SCRATCH/w/build.rc 2>/dev/null)"
if [ -n "${STAGE_ONLY:-}" ]; then  # only the site, the wheel and the model, for steps 5 and 6 (no server, no knee)
  [ "$(cat $SCRATCH/w/build.rc 2>/dev/null)" = 0 ] || { tail -5 $SCRATCH/w/build.log; exit 7; }
  echo "staged at $(el)s"; exit 0
fi
bash $D/serve.sh bf16
export PYTHONPATH=$SCRATCH/gw:$SCRATCH/site
cd $SCRATCH/w   # not the repo root: the gateway comes from the wheel
python3 -c "import vllm, gateway, litestar, redis, hiredis; print('vllm', vllm.__version__, 'gateway imports ok')" | tee -a $OUT/versions.txt || exit 5
cat > $SCRATCH/w/policy.yaml <<YAML
listen: {host: 127.0.0.1, port: 8080}
store: {kind: redis, url: "redis://127.0.0.1:6390/0"}
health: {interval: 2, backoff_initial: 1, backoff_max: 4}
timeouts: {read: 300}
models:
  - name: qwen3-4b
    queue: {max_depth: 4096, max_wait: 120}
    backends:
      - name: h200-0
        url: "http://127.0.0.1:8000"
        cap: 1  # replaced by llm-gateway knee --write-cap
YAML
if ! python3 $D/health.py 330 $SCRATCH/w/vllm-bf16.log; then tail -60 $SCRATCH/w/vllm-bf16.log; tail -300 $SCRATCH/w/vllm-bf16.log > $OUT/vllm-bf16.log; exit 6; fi
echo "healthy at $(el)s"; bash $D/smoke.sh
REM=$(( ${STEP2_BUDGET:-575} - $(el) )); echo "knee budget ${REM}s"
if [ -n "${CAP:-}" ]; then  # a repeat of the overload alone: the cap a knee run found earlier, no sweep
  sed -i "s/cap: 1 .*/cap: $CAP/" $SCRATCH/w/policy.yaml
else
python3 -m gateway knee --url http://127.0.0.1:8000 --model qwen3-4b --levels ${LEVELS:-1,2,4,8,16,32,64,96,128,192,256,384,512} \
  --prompt-tokens 256 --output-tokens 128 --duration ${DURATION:-8} --warmup 2 --max-time $REM --out $OUT/knee-bf16 \
  --write-cap $SCRATCH/w/policy.yaml --backend h200-0 2>&1 | tee $OUT/knee-bf16.txt
fi
cp $SCRATCH/w/policy.yaml $OUT/policy.yaml
grep -E "Maximum concurrency|KV cache|max_num_seqs|CUDA graph|torch.compile" $SCRATCH/w/vllm-bf16.log | head -12 > $OUT/vllm-bf16.log
echo "step2 took $(el)s"
