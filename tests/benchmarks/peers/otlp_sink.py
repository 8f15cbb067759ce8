"""A local OTLP/HTTP collector stand-in for the tracing comparison: answers every export with success and
counts what it got (GET /stats), without decoding it, so it takes little of the load generators' core.

Run: python -m tests.benchmarks.peers.otlp_sink PORT
"""

from __future__ import annotations

import http.server
import json
import sys

STATS = {"exports": 0, "bytes": 0}


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector answers the exporter's pooled connection

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        STATS["bytes"] += len(self.rfile.read(int(self.headers.get("content-length", 0))))
        STATS["exports"] += 1
        self.reply(b"", "application/x-protobuf")  # an empty ExportTraceServiceResponse: all accepted

    def do_GET(self) -> None:  # noqa: N802
        self.reply(json.dumps(STATS).encode(), "application/json")

    def reply(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
