#!/usr/bin/env python3
"""Diagnostic sampler beside step5: both servers' running/waiting/KV use every 0.5 s, and for each gateway process
that appears, py-spy for 25 s (starting 15 s after it appears) plus its /metrics every 5 s. Bounded by --seconds."""
import os, re, subprocess, sys, time, urllib.request
out, spy, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
end = time.time() + seconds
seen, spied = {}, set()
series = open(os.path.join(out, "vllm-series.txt"), "a")
pat = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)\{[^}]*\} (\S+)", re.M)
def get(url, t=1.0):
    try:
        return urllib.request.urlopen(url, timeout=t).read().decode(errors="replace")
    except Exception:
        return ""
def gw_port(pid):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
    except Exception:
        return None
    for arg in cmd:
        m = re.search(r"policy-.*-(\d+)\.yaml$", arg)
        if m:
            return m.group(1)
    return None
last_metrics = {}
while time.time() < end:
    t = time.time()
    for p in (8000, 8001):
        for name, val in pat.findall(get(f"http://127.0.0.1:{p}/metrics")):
            series.write(f"{t:.2f} {p} {name} {val}\n")
    series.flush()
    try:
        pids = subprocess.run(["pgrep", "-f", "gateway serve"], capture_output=True, text=True, timeout=3).stdout.split()
    except Exception:
        pids = []
    for pid in pids:
        seen.setdefault(pid, t)
        if pid not in spied and t - seen[pid] > 15:
            spied.add(pid)
            subprocess.Popen([spy, "record", "-d", "25", "-r", "97", "--idle",
                              *(["--native"] if os.environ.get("SPY_NATIVE") else []), "--format", "raw", "-o",
                              os.path.join(out, f"pyspy-{pid}.txt"), "-p", pid],
                             stdout=open(os.path.join(out, f"pyspy-{pid}.log"), "w"), stderr=subprocess.STDOUT)
        if t - last_metrics.get(pid, 0) > 5:
            port = gw_port(pid)
            if port:
                text = get(f"http://127.0.0.1:{port}/metrics", 2)
                if text:
                    open(os.path.join(out, f"gw-metrics-{pid}.txt"), "w").write(text)
                    try:
                        fds = len(os.listdir(f"/proc/{pid}/fd"))
                    except Exception:
                        fds = -1
                    open(os.path.join(out, f"gw-fds-{pid}.txt"), "a").write(f"{t:.2f} {fds}\n")
                    last_metrics[pid] = t
    time.sleep(max(0.0, 0.5 - (time.time() - t)))
