"""POST /v1/embeddings: vectors from a model served for pooling (`--runner pooling`)."""

from gateway.endpoints.base import Route
from policies.tokens import INPUT

ROUTE = Route("embeddings", "/v1/embeddings", tokens=INPUT, rentable=True)
