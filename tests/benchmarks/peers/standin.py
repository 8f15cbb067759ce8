"""The stand-in OpenAI backend (nginx serving fixed bodies) and nginx as a plain reverse proxy (the floor).

nginx cannot branch on the request body, so the stand-in listens on two ports: one answers every
POST /v1/chat/completions with a fixed `chat.completion`, the other with a fixed SSE stream of `TOKENS` chunk
events, a usage chunk and `data: [DONE]`. Each system under test is pointed at the JSON port for its
non-streaming model and at the SSE port for its streaming model. Both ports also answer GET /health and
GET /v1/models (health checks and startup probes).

nginx's static handler refuses POST (405); `return 405` plus `error_page 405 =200 /_/file` turns that into an
internal GET of the fixed file with status 200, read from the page cache with sendfile: thousands of
responses per second on one core, which `run.py` measures (the "direct" column).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import orjson

MODEL = "bench"  # served name = public name everywhere, so no system has to rename anything
TOKENS = 256
CREATED = 1_700_000_000


def chat_completion() -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": CREATED, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
    })


def sse_stream(tokens: int = TOKENS) -> bytes:
    events = []
    for i in range(tokens):
        delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f" tok{i}"}
        events.append({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED,
                       "model": MODEL, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                    "finish_reason": "length" if i == tokens - 1 else None}]})
    events.append({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
                   "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": tokens,
                                            "total_tokens": 12 + tokens}})
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def models_list() -> bytes:
    return orjson.dumps({"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "bench", "max_model_len": 4096}]})


COMMON = """
worker_processes 1;
{user}
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_timeout 300s;
    keepalive_requests 10000000;
    client_body_buffer_size 64k;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
{servers}
}}
"""

STANDIN_SERVER = """
    server {{
        listen 127.0.0.1:{port} backlog=4096 reuseport;
        location = /health {{ default_type application/json; return 200 '{{"status":"ok"}}'; }}
        location = /v1/models {{ default_type application/json; alias {dir}/models.json; }}
        location = /v1/chat/completions {{ error_page 405 =200 /_/{file}; return 405; }}
        location = /v1/completions {{ error_page 405 =200 /_/{file}; return 405; }}
        location /_/ {{ internal; alias {dir}/; default_type {mime}; }}
    }}
"""

FLOOR_SERVER = """
    upstream up{port} {{ server 127.0.0.1:{upstream}; keepalive 256; keepalive_requests 10000000; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096 reuseport;
        location / {{
            proxy_pass http://up{port};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering {buffering};
        }}
    }}
"""


@dataclass
class NginxConf:
    dir: Path
    conf: Path

    def command(self) -> list[str]:
        return ["nginx", "-p", str(self.dir), "-c", str(self.conf), "-g", "daemon off;"]


def _write(dir: Path, servers: str) -> NginxConf:
    dir.mkdir(parents=True, exist_ok=True)
    user = "user root;" if os.geteuid() == 0 else ""  # as root nginx would switch to `nobody` otherwise
    conf = dir / "nginx.conf"
    conf.write_text(COMMON.format(dir=dir, user=user, servers=servers))
    return NginxConf(dir, conf)


def standin_conf(dir: Path, json_port: int, sse_port: int) -> NginxConf:
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "chat.json").write_bytes(chat_completion())
    (dir / "stream.sse").write_bytes(sse_stream())
    (dir / "models.json").write_bytes(models_list())
    servers = STANDIN_SERVER.format(port=json_port, dir=dir, file="chat.json", mime="application/json")
    servers += STANDIN_SERVER.format(port=sse_port, dir=dir, file="stream.sse", mime="text/event-stream")
    return _write(dir, servers)


def floor_conf(dir: Path, json_port: int, sse_port: int, upstream_json: int, upstream_sse: int) -> NginxConf:
    servers = FLOOR_SERVER.format(port=json_port, upstream=upstream_json, buffering="on")
    servers += FLOOR_SERVER.format(port=sse_port, upstream=upstream_sse, buffering="off")  # relay as it comes
    return _write(dir, servers)
