"""The HTTP shell's own parts, below every route: the bounded edge (heads, bodies, trailers, idle and slow
clients, connection room), the server that drains before it stops, the ASGI types every route is written
against, the bounded form upload, the bounded shutdown steps, and the error shapes the edge answers in."""
