#!/usr/bin/env python3
"""Wait (bounded) for vLLM /health; exit 0 when healthy, 1 if the server died or time ran out.
usage: health.py SECONDS LOG [PORT]   (the pid file as serve.sh writes it for that port; default 8000)"""
import os, sys, time, urllib.request
limit = float(sys.argv[1]); log = sys.argv[2]; port = int(sys.argv[3]) if len(sys.argv) > 3 else 8000
w = os.path.join(os.environ.get("SCRATCH", "/tmp/gpubench"), "w")
pid = int(open(os.path.join(w, "vllm.pid" if port == 8000 else f"vllm-{port}.pid")).read())
t0 = time.time(); last = 0
while time.time() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        print(f"server :{port} died after {time.time()-t0:.0f}s"); sys.exit(1)
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            print(f"healthy :{port} after {time.time()-t0:.1f}s"); sys.exit(0)
    except Exception:
        pass
    if time.time() - last > 20:
        last = time.time()
        try:
            ln = [l for l in open(log, errors="replace").read().splitlines() if l.strip()]
            print(f"[{time.time()-t0:.0f}s :{port}] {ln[-1][:220] if ln else ''}", flush=True)
        except OSError:
            pass
    time.sleep(1)
print(f"timeout :{port}"); sys.exit(1)
