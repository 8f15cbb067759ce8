#!/bin/bash
SCRATCH=${SCRATCH:-/tmp/gpubench}
# Stop every vLLM server serve.sh started (each one's whole process group: vllm.pid, vllm-PORT.pid), wait for
# the GPU to free.
PIDS=$(cat $SCRATCH/w/vllm*.pid 2>/dev/null) || true
[ -n "$PIDS" ] || { echo "no pid file"; exit 0; }
for P in $PIDS; do kill -TERM -- -$P 2>/dev/null || kill -TERM $P 2>/dev/null; done
for P in $PIDS; do
  for _ in $(seq 1 60); do kill -0 $P 2>/dev/null || break; sleep 0.5; done
  kill -0 $P 2>/dev/null && { echo "SIGKILL group $P"; kill -KILL -- -$P 2>/dev/null; sleep 2; }
done
rm -f $SCRATCH/w/vllm*.pid
for _ in $(seq 1 30); do
  U=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  [ "${U:-0}" -lt 2000 ] && break; sleep 1
done
echo "stopped" $PIDS"; GPU memory used now ${U:-?} MiB"
