"""tests/support/rented_standin.py starts where it answers itself: a port that another server took between the
choice and the bind is not mistaken for the stand-in (that mistake sent a test's rented calls to a stranger)."""

from __future__ import annotations

import http.server
import threading

import httpx

from tests.support import rented_standin
from tests.support.servers import free_port


class Stranger(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


def test_a_standin_whose_port_was_taken_starts_again_on_another(monkeypatch, tmp_path):
    stranger = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        taken = stranger.server_address[1]
        ports = iter([taken, free_port()])
        monkeypatch.setattr(rented_standin, "free_port", lambda: next(ports))
        with rented_standin.running_standin(monkeypatch, str(tmp_path / "rented.jsonl")) as (url, _key):
            assert f":{taken}/" not in url
            assert httpx.get(url.removesuffix("/v1") + "/health").json()["standin"]  # the stand-in itself
    finally:
        stranger.shutdown()
