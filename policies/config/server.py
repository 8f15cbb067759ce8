"""The gateway's own listener, the bounded edge on both sides, timeouts and health checks."""

from __future__ import annotations

from pydantic import Field

from policies.config.base import Seconds, Strict


class Listen(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)


class Timeouts(Strict):
    connect: Seconds = 5.0
    read: Seconds = 600.0
    write: Seconds = 30.0
    health_check: Seconds = 2.0


class UpstreamLimits(Strict):
    """What one answer of a backend or rented provider may be (the bounded edge, outbound): past a bound the
    client gets a 502 (mid-stream, a final error event) naming it, and the gateway holds no more than it."""

    max_header_bytes: int = Field(64 * 1024, ge=4096, le=16 * 1024**2)  # status line and headers
    header_seconds: Seconds = 30.0  # from the first byte of an answer's head to its end (a dripped head)
    max_body_bytes: int = Field(32 * 1024**2, ge=64 * 1024, le=4 * 1024**3)  # a non-streamed answer, read whole
    max_event_bytes: int = Field(8 * 1024**2, ge=64 * 1024, le=1024**3)  # one event of a streamed answer


class Health(Strict):
    interval: Seconds = 5.0
    failure_threshold: int = Field(1, ge=1, le=100)
    backoff_initial: Seconds = 1.0
    backoff_max: Seconds = 60.0


class Server(Strict):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=1024**3)
    # the audio routes' multipart uploads, streamed through to the replica (OpenAI's own limit is 25 MB)
    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1024, le=16 * 1024**3)
    # SIGTERM (a rolling update) first drains: /ready answers 503 while every route keeps serving this long,
    # so the Service stops routing here before the listener closes. 0: close at once (a process nobody
    # reaches through a Service); the Helm chart sets it with shutdown_timeout from one value.
    drain_seconds: float = Field(0.0, ge=0, le=3600)
    # after the drain: how long requests in flight (streams) may take to finish before they are cut
    shutdown_timeout: Seconds = 30.0
    # The client side of the bounded edge (gateway/http/edge.py). The request line and headers: 431 beyond (Envoy's
    # default is 60 KiB, nginx's 4 x 8 KiB; an API request's head is well under 8 KiB).
    max_header_bytes: int = Field(64 * 1024, ge=4096, le=1024**2)
    # from a new connection's accept, or a request's first byte, to the end of its headers: 408 beyond (slowloris)
    header_timeout: Seconds = 30.0
    # the longest wait for the next bytes of a request body (nginx's client_body_timeout is 60 s): 408 beyond
    body_timeout: Seconds = 60.0
    # the least average rate of a body once it has taken 5 s (1 KiB/s: a 25 MB upload may take ~7 h; one byte
    # per half second is cut after 5 s): 408 beyond
    body_min_rate: int = Field(1024, ge=0, le=1024**3)
    # idle keep-alive: longer than the load balancers in front (AWS ALB 60 s, nginx 60-75 s), so that the balancer
    # closes an idle connection first; a server that closes first races the balancer's reuse of it (the 502s and
    # "server disconnected" that a 5 s keep-alive gives about once in a few thousand requests)
    keepalive_seconds: Seconds = 90.0
    # client connections at once; beyond it the longest-idle one makes room, and only when all serve requests a
    # new one gets a fast 503 (Retry-After: 1). Also kept under half the process's file limit (see
    # gateway/http/edge.py).
    max_connections: int = Field(4096, ge=1, le=1_000_000)
