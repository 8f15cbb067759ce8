"""vLLM's pooling routes, served by a model started with `--runner pooling`: rerank (vLLM's three paths, Cohere
and Jina shaped), score (/score and its older /v1/score), the raw /pooling output and /classify. Each reports
`usage.prompt_tokens`; the estimate reserves the text it is given."""

from gateway.endpoints.base import Route
from policies.tokens import Estimate, fields_prompt, no_output

TEXT = Estimate(fields_prompt("query", "documents", "text_1", "text_2", "queries", "data", "input"), no_output)

RERANK = Route("rerank", "/rerank", tokens=TEXT)
RERANK_V1 = Route("rerank", "/v1/rerank", tokens=TEXT)
RERANK_V2 = Route("rerank", "/v2/rerank", tokens=TEXT)
SCORE = Route("score", "/score", tokens=TEXT)
SCORE_V1 = Route("score", "/v1/score", tokens=TEXT)
POOLING = Route("pooling", "/pooling", tokens=TEXT)
CLASSIFY = Route("classify", "/classify", tokens=TEXT)
