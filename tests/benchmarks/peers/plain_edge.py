"""`llm-gateway` with uvicorn's own httptools protocol instead of the bounded edge (gateway/http/edge.py), for
`make bench ARGS=--edge-compare`: the baseline that tells what the client-side bounds cost per request."""

import sys

import gateway.http.edge
from gateway.cli import main

gateway.http.edge.uvicorn_options = lambda server: {"timeout_keep_alive": server.keepalive_seconds}

if __name__ == "__main__":
    sys.exit(main())
