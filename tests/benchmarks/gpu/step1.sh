#!/bin/bash
# Step 1 on the H200 machine: stage part 1 of the packed site, unpack the carried redis-server, build the random
# Qwen3-4B-shaped checkpoint in the background (its own session: it outlives this command). Run from the repo root:
#   bash .cache/gpu/s/step1.sh        (carry .cache/gpu/s .cache/gpu/p1 .cache/gpu/x)
set -u; D=$(cd "$(dirname "$0")" && pwd); OUT=$(cd "${OUT:?}" && pwd); X=${X:-.cache/gpu/x}; SCRATCH=${SCRATCH:-/tmp/gpubench}; export SCRATCH
T0=$(date +%s); mkdir -p $SCRATCH/w $SCRATCH/tok
cp .cache/gpu/p1/site.tar.xz.part* $SCRATCH/w/ && cp $X/tok/* $SCRATCH/tok/ || exit 2
setsid nohup bash -c "python3 $D/build_model.py $SCRATCH/q4b $SCRATCH/tok > $SCRATCH/w/build.log 2>&1; echo \$? > $SCRATCH/w/build.rc" >/dev/null 2>&1 </dev/null &
{
  date -u +%FT%TZ; nproc; free -g | head -2; df -h $SCRATCH | tail -1; uname -r
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys,torch,transformers,triton; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__)'
  echo "redis-server on the image: $(command -v redis-server || echo none)"; command -v xz || echo "no xz"
} 2>&1 | tee $OUT/machine.txt
if ! command -v redis-server >/dev/null; then
  mkdir -p $SCRATCH/redis && tar -xJf $X/redis.tar.xz -C $SCRATCH/redis
  LD_LIBRARY_PATH=$SCRATCH/redis/lib $SCRATCH/redis/redis-server --version | tee -a $OUT/machine.txt
fi
for i in $(seq 1 60); do [ -f $SCRATCH/w/build.rc ] && break; sleep 1; done
echo "build.rc=$(cat $SCRATCH/w/build.rc 2>/dev/null) after $(( $(date +%s) - T0 ))s"; head -2 $SCRATCH/w/build.log
