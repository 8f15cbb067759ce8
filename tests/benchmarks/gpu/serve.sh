#!/bin/bash
SCRATCH=${SCRATCH:-/tmp/gpubench}
# Start vLLM's OpenAI server on $SCRATCH/q4b in its own session (outlives the command that started it).
# usage: [PORT=8000] [GPU_UTIL=0.9] serve.sh LABEL [extra vllm args...]
#   log: $SCRATCH/w/vllm-LABEL.log  pid: $SCRATCH/w/vllm.pid on port 8000, $SCRATCH/w/vllm-PORT.pid on another
LABEL=$1; shift
PORT=${PORT:-8000}; PIDF=$SCRATCH/w/vllm.pid; [ "$PORT" = 8000 ] || PIDF=$SCRATCH/w/vllm-$PORT.pid
export PYTHONPATH=$SCRATCH/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
cd $SCRATCH/w || exit 2
setsid nohup python3 -m vllm.entrypoints.openai.api_server --model $SCRATCH/q4b --served-model-name qwen3-4b \
  --host 127.0.0.1 --port $PORT --max-model-len 4096 --gpu-memory-utilization ${GPU_UTIL:-0.9} \
  --disable-uvicorn-access-log "$@" > $SCRATCH/w/vllm-$LABEL.log 2>&1 < /dev/null &
echo $! > $PIDF
echo "started vllm ($LABEL) on :$PORT pid $(cat $PIDF) args: $*"
