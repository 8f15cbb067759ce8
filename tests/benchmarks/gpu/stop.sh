#!/bin/bash
SCRATCH=${SCRATCH:-/tmp/gpubench}
# Stop the vLLM server started by serve.sh (its whole process group), wait for the GPU to free.
P=$(cat $SCRATCH/w/vllm.pid 2>/dev/null) || { echo "no pid file"; exit 0; }
kill -TERM -- -$P 2>/dev/null || kill -TERM $P 2>/dev/null
for i in $(seq 1 60); do kill -0 $P 2>/dev/null || break; sleep 0.5; done
kill -0 $P 2>/dev/null && { echo "SIGKILL group $P"; kill -KILL -- -$P 2>/dev/null; sleep 2; }
for i in $(seq 1 30); do
  U=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  [ "${U:-0}" -lt 2000 ] && break; sleep 1
done
echo "stopped $P; GPU memory used now ${U:-?} MiB"
