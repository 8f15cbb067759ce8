#!/usr/bin/env python3
"""Each vLLM server's own output rate over a window: vllm:generation_tokens_total and vllm:num_requests_running
read from /metrics every 0.5 s, from --delay to --delay + --seconds (bounded). Loopback only.
usage: rates.py --urls http://127.0.0.1:8000,http://127.0.0.1:8001 --labels bf16,fp8 --delay 4 --seconds 8 --out F
Writes {label: {"output_tokens_per_s", "running_mean", "held_mean" (running + waiting), "seconds", "samples"}}."""
import argparse, json, re, time, urllib.request

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read(url):
    text = OPENER.open(url + "/metrics", timeout=3).read().decode()
    def total(name):
        return sum(float(v) for v in re.findall(r"^" + re.escape(name) + r"(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M))
    return (total("vllm:generation_tokens_total"), total("vllm:num_requests_running"),
            total("vllm:num_requests_waiting"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--urls", required=True); ap.add_argument("--labels", required=True)
    ap.add_argument("--delay", type=float, default=0.0); ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    urls, labels = a.urls.split(","), a.labels.split(",")
    assert len(urls) == len(labels), "one label per URL"
    assert all(u.startswith(("http://127.0.0.1:", "http://localhost:")) for u in urls), "loopback URLs only"
    time.sleep(a.delay)
    samples = {label: [] for label in labels}  # (time, generated tokens, running, waiting)
    end = time.monotonic() + a.seconds
    while True:
        now = time.monotonic()
        for url, label in zip(urls, labels):
            try:
                samples[label].append((time.monotonic(), *read(url)))
            except OSError:
                pass
        if now >= end:
            break
        time.sleep(max(0.0, min(0.5, end - time.monotonic())))
    out = {}
    for label, s in samples.items():
        ok = len(s) >= 2 and s[-1][0] > s[0][0]
        out[label] = {"output_tokens_per_s": round((s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]), 1) if ok else None,
                      "running_mean": round(sum(x[2] for x in s) / len(s), 1) if s else None,
                      "held_mean": round(sum(x[2] + x[3] for x in s) / len(s), 1) if s else None,
                      "seconds": round(s[-1][0] - s[0][0], 1) if ok else None, "samples": len(s)}
    json.dump(out, open(a.out, "w"), indent=1)
    print("rates", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
