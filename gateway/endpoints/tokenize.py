"""vLLM's POST /tokenize and /detokenize: the model's own tokenizer, nothing generated (requests metered, no
tokens reserved or counted)."""

from gateway.endpoints.base import Route, no_usage

TOKENIZE = Route("tokenize", "/tokenize", usage=no_usage)
DETOKENIZE = Route("detokenize", "/detokenize", usage=no_usage)
