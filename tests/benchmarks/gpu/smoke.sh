#!/bin/bash
SCRATCH=${SCRATCH:-/tmp/gpubench}
python3 - <<'PY'
import json, time, urllib.request
b = json.dumps({"model": "qwen3-4b", "prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0, "ignore_eos": True}).encode()
t = time.time()
r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8000/v1/completions", b, {"content-type": "application/json"}), timeout=60)
j = json.loads(r.read()); print(f"smoke {time.time()-t:.3f}s", json.dumps(j)[:400])
PY
